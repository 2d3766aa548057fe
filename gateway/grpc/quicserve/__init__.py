"""Protobuf packages under ``quicserve.*`` (see ``v1``)."""
