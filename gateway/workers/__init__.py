"""Local worker processes and remote worker connections: supervision, restarts, discovery."""
