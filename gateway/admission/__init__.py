"""Admission: auth, rate limits, load shedding and schema validation, before any worker is asked."""
