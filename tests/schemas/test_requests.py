from __future__ import annotations

import pytest

from schemas.errors import InvalidIdError, InvalidRequestError
from schemas.ids import check_session_id, split_tool_name, turn_id_for
from schemas.requests import parse_request


@pytest.mark.parametrize(
    ("body", "reason", "words"),
    [
        (b"{not json", "malformed_json", "not valid JSON"),
        (b'{"message": "hi \\ud83d"}', "malformed_json",
         "\\ud83d at byte 16 is half of a UTF-16 surrogate pair"),
        (b'{"message": "\\\\ud800 \\ud83d\\ude00 \\udc00"}', "malformed_json",
         "invalid utf-16 surrogate pair"),
        (b"[1, 2]", "invalid_request", "must be a JSON object, got an array"),
        (b'{"calls": "echo"}', "invalid_request", "calls must be a list"),
        (b'{"calls": []}', "invalid_request", "calls is empty"),
        (b'{"calls": [{"tool": 5}]}', "invalid_request", "calls[0].tool must be a string"),
        (b'{"calls": [7]}', "invalid_request", "calls[0] must be an object"),
        (b'{"request_id": 3, "calls": [{"tool": "a:b"}]}', "invalid_request", "request_id"),
        (b'{"request_id": "auto-1", "calls": [{"tool": "a:b"}]}', "invalid_request", "reserved"),
        (b'{"calls": [{"tool": "a:b"}], "extra": 1}', "invalid_request", "unknown field(s) extra"),
        (b'{"calls": [{"tool": "a:b", "args": {}}]}', "invalid_request", "calls[0] has unknown"),
        (b'{"message": ""}', "invalid_request", "non-empty string, got an empty string"),
        (b'{"message": " \\n"}', "invalid_request", "non-empty string, got only whitespace"),
        (b'{"message": 7}', "invalid_request", "non-empty string, got a number"),
        (b'{"messages": [{"role": "system", "content": "x"}]}', "invalid_request",
         "messages[0].role must be user or assistant, got 'system' (the agent's "
         "instructions come from its manifest)"),
        (b'{"messages": [{"role": 5, "content": "x"}]}', "invalid_request",
         "role must be user or assistant, got a number"),
    ],
)
def test_bad_request_bodies_are_refused_naming_the_field(body, reason, words) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_request(body)
    assert info.value.reason == reason
    assert words in info.value.message


def test_an_oversized_request_is_refused_with_the_limit() -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_request(b"x" * 2000, max_bytes=1000)
    assert info.value.reason == "payload_too_large"
    assert "2000 bytes" in info.value.message and "1000" in info.value.message


def test_too_many_calls_are_refused() -> None:
    body = b'{"calls": [' + b",".join([b'{"tool": "a:b"}'] * 5) + b"]}"
    with pytest.raises(InvalidRequestError) as info:
        parse_request(body, max_calls=4)
    assert info.value.reason == "too_many_calls"


def test_a_valid_request_keeps_non_object_arguments_for_a_per_call_rejection() -> None:
    req = parse_request(b'{"request_id": "r", "calls": [{"tool": "a:b", "arguments": [1]},'
                        b' {"tool": "a:c", "_reasoningForCall": "why"}]}')
    assert req.request_id == "r"
    assert req.calls[0].arguments == [1]
    assert req.calls[1].arguments == {} and req.calls[1].reasoning == "why"


@pytest.mark.parametrize("bad", ["", "a.b", "a b", "x" * 129, "é", "a>"])
def test_session_ids_must_be_nats_token_safe(bad: str) -> None:
    with pytest.raises(InvalidIdError, match="session id"):
        check_session_id(bad)


@pytest.mark.parametrize("bad", ["echo", "a:b:c", ":b", "a.b:c", "a:b c"])
def test_tool_names_must_be_namespace_colon_tool(bad: str) -> None:
    with pytest.raises(InvalidIdError, match="tool name"):
        split_tool_name(bad)


def test_turn_ids_are_token_safe_and_deterministic() -> None:
    assert turn_id_for("abc") == "abc"
    long_id = turn_id_for("order 42 / retry")
    assert long_id == turn_id_for("order 42 / retry")
    check_session_id(long_id)


def test_injected_strings_lose_control_and_invisible_format_characters() -> None:
    import sys
    import unicodedata

    from schemas.requests import strip_controls

    every_cf = "".join(chr(c) for c in range(sys.maxunicode)
                       if unicodedata.category(chr(c)) == "Cf")
    # Only the joiners scripts and emoji need are kept.
    assert strip_controls(every_cf) == "\u200c\u200d"
    hidden = "pay\u202e\U000E0041\U000E0042 now\u200b\x07\x1b[31m\tok\n"
    assert strip_controls({"k\u2066ey": [hidden]}) == {"key": ["pay now[31m\tok\n"]}


def test_a_cancel_request_names_a_turn_and_may_say_why() -> None:
    req = parse_request(b'{"cancel": "t-1", "reason": "stop\\u0007 now", "request_id": "c1"}')
    assert (req.cancel, req.reason, req.request_id, req.calls) == \
        ("t-1", "stop now", "c1", [])
    for body, says in [
        (b'{"cancel": "a.b"}', "cancel must be a turn id"),
        (b'{"cancel": 5}', "cancel must be a turn id"),
        (b'{"cancel": "t", "message": "hi"}', "not message"),
        (b'{"cancel": "t", "reason": ""}', "reason must be a non-empty string"),
        (b'{"reason": "why"}', "a cancel request has cancel"),
        (b'{"cancel": "t", "reason": "' + b"x" * 1001 + b'"}', "at most 1000"),
    ]:
        with pytest.raises(InvalidRequestError, match=says):
            parse_request(body)
