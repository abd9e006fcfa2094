"""Actors: a pure `decide` each, plus a short I/O loop over a durable consumer."""
