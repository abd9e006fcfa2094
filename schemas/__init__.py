"""Pure data for toolbus: events, requests, tool specs, session state and its reducer.

Nothing here does I/O, reads a clock or makes a random id: time and ids come in as
arguments, so every function can be replayed and property-tested.
"""
