

def test_a_schema_met_again_is_compiled_once() -> None:
    # The planner's match, think and composed schemas and a latent tool's output come
    # back at every model call: compiled, and costed, each time, they took milliseconds.
    from schemas.validation import validator_for

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    first = validator_for(schema)
    assert validator_for({"type": "object", "properties": {"n": {"type": "integer"}}}) \
        is first
    assert first.check({"n": "x"})[1] and not first.check({"n": 1})[1]
    assert validator_for({"type": "string"}) is not first
