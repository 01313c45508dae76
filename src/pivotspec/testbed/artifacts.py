"""Registered names of the shipped testbed models (filled in when their artifacts exist)."""

REGISTERED: dict = {}
