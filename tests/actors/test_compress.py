"""actors/compress.py: previews within budget, recall pages, JMESPath transforms."""

from __future__ import annotations

import base64
import random
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.compress import (
    MIN_BUDGET,
    TransformError,
    needs_compression,
    preview,
    recall,
    result_text,
    transform,
)
from tests.github import COMMITS


def _pages(result: Any, **kwargs: Any) -> list[dict[str, Any]]:
    pages = [recall(result, **kwargs)]
    while pages[-1].get("next_offset") is not None:
        pages.append(recall(result, offset=pages[-1]["next_offset"], **kwargs))
    return pages


# -- the seed's example

def test_the_commit_fixture_is_the_seeds_31k_characters() -> None:
    assert 30_000 <= len(result_text(COMMITS)) <= 32_000
    assert needs_compression(COMMITS, 800)


def test_a_large_array_previews_as_the_seeds_stored_summary_within_800_characters() -> None:
    text = preview(COMMITS, key="_tool_result_1", tool="github:list_commits")
    lines = text.split("\n")
    assert len(text) <= 800
    assert lines[0] == "[STORED: _tool_result_1 | github:list_commits]"
    assert lines[1] == "Type: Array(30)"
    assert lines[2].startswith("Schema: sha, ")
    for path in ("sha", "commit.message", "author.login"):
        assert f" {path}," in lines[2]
    assert lines[3] == "Preview (first 3):"
    assert [line[:4] for line in lines[4:7]] == ["[0] ", "[1] ", "[2] "]
    assert f"sha={COMMITS[0]['sha'][:15]}…" in lines[4]
    assert 'commit.message="chore: update bun.lock"' in lines[4]
    assert lines[7] == ('...27 more — use recall("_tool_result_1") or _transform to '
                        "access full data")


def test_the_preview_is_the_same_text_every_time() -> None:
    first = preview(COMMITS, key="_tool_result_1", tool="github:list_commits")
    again = preview(msgspec.json.decode(msgspec.json.encode(COMMITS)),
                    key="_tool_result_1", tool="github:list_commits")
    assert first == again


def test_json_text_from_an_mcp_server_previews_as_the_array_it_holds() -> None:
    text = result_text(COMMITS)
    assert preview(text, key="k", tool="t") == preview(COMMITS, key="k", tool="t")


def test_the_items_option_sets_how_many_items_are_previewed() -> None:
    text = preview(COMMITS, key="k", tool="t", budget=1200, items=5)
    assert "Preview (first 5):" in text and "[4] " in text and "...25 more" in text
    assert len(text) <= 1200


def test_an_object_holding_a_large_array_previews_that_array_with_its_path() -> None:
    result = {"total_count": 30, "incomplete_results": False, "items": COMMITS}
    text = preview(result, key="_tool_result_2", tool="github:search_commits")
    lines = text.split("\n")
    assert len(text) <= 800
    assert lines[1] == "Type: Object(3 keys)"
    assert lines[2].startswith("Fields: total_count=30, incomplete_results=false")
    assert "At items: Array(30)" in lines
    assert "Preview (first 3):" in lines
    assert lines[-1].startswith('...27 more — use recall("_tool_result_2", path="items")')


def test_an_object_without_a_large_array_previews_its_schema_and_fields() -> None:
    result = {f"field_{i}": {"value": "x" * 50, "rank": i} for i in range(20)}
    text = preview(result, key="k", tool="t")
    lines = text.split("\n")
    assert len(text) <= 800
    assert lines[1] == "Type: Object(20 keys)"
    assert lines[2].startswith("Schema: field_0.value, field_0.rank, field_1.value")
    assert lines[3].startswith("Fields: field_0=")
    assert lines[-1] == 'use recall("k") or _transform to access full data'


def test_long_text_previews_its_head_and_tail_with_the_omitted_count() -> None:
    text = "".join(f"line {i}: {'word ' * 8}\n" for i in range(800))
    out = preview(text, key="_tool_result_3", tool="shell:run")
    lines = out.split("\n")
    assert len(out) <= 800
    assert lines[1] == f"Type: Text({len(text)} chars)"
    assert out.split("\n", 2)[2].startswith(text[:100])
    marker = next(line for line in lines if line.startswith("[... "))
    omitted = int(marker.split()[1])
    head = out.split("\n", 2)[2].split("\n[... ")[0]
    tail = out.split(" chars omitted ...]\n", 1)[1].rsplit("\nuse recall", 1)[0]
    assert len(head) + omitted + len(tail) == len(text)
    assert text.startswith(head) and text.endswith(tail)
    assert lines[-1] == f'use recall("_tool_result_3", offset={len(head)}) to read the ' \
                        "omitted part"


def test_a_binary_result_is_described_by_its_type_and_size_not_its_bytes() -> None:
    data = bytes(range(256)) * 711 + b"\x00" * 28
    result = {"content": [{"type": "image", "data": base64.b64encode(data).decode(),
                           "mimeType": "image/png"}]}
    out = preview(result, key="_tool_result_4", tool="browser:screenshot")
    assert out == ("[STORED: _tool_result_4 | browser:screenshot]\n"
                   f"Binary: image/png, {len(data):,} bytes")
    assert f"{len(data):,}" == "182,044"


def test_mixed_content_lists_each_block() -> None:
    image = base64.b64encode(b"\x89PNG" * 500).decode()
    result = {"content": [{"type": "text", "text": "Here is the page:\n" + "x" * 900},
                          {"type": "image", "data": image, "mimeType": "image/png"}]}
    lines = preview(result, key="k", tool="t").split("\n")
    assert lines[1] == "Type: Content(2 blocks)"
    assert lines[2].startswith('[0] Text(918 chars) "Here is the page:…"')
    assert lines[3] == "[1] Binary: image/png, 2,000 bytes"


def test_a_budget_under_the_minimum_or_a_long_key_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 200"):
        preview(COMMITS, key="k", tool="t", budget=MIN_BUDGET - 1)
    with pytest.raises(ValueError, match="1 to 64 characters"):
        preview(COMMITS, key="k" * 65, tool="t")


# -- recall

def test_recall_pages_reassemble_the_whole_array() -> None:
    pages = _pages(COMMITS, budget=2500)
    assert len(pages) > 1
    assert [item for page in pages for item in page["items"]] == COMMITS
    for page in pages:
        assert page["type"] == "array" and page["total"] == 30
        assert len(result_text(page["items"])) <= 2500
        assert "note" not in page


def test_recall_with_a_limit_pages_by_that_many_items() -> None:
    pages = _pages(COMMITS, limit=2, budget=5000)
    assert [page["count"] for page in pages] == [2] * 15
    assert [item for page in pages for item in page["items"]] == COMMITS
    assert pages[-1]["next_offset"] is None and pages[0]["next_offset"] == 2


def test_recall_with_a_path_pages_the_selected_part() -> None:
    result = {"total_count": 30, "items": COMMITS}
    pages = _pages(result, path="items[].commit.message", budget=300)
    assert [m for page in pages for m in page["items"]] == \
        [c["commit"]["message"] for c in COMMITS]
    assert all(page["path"] == "items[].commit.message" for page in pages)


def test_recall_pages_text_by_characters() -> None:
    text = "ünïcødé " * 1000
    pages = _pages(text, budget=700)
    assert "".join(page["text"] for page in pages) == text
    assert pages[1]["offset"] == 700 and pages[0]["total"] == len(text)


def test_recall_pages_an_object_by_keys() -> None:
    result = {f"k{i}": "v" * 40 for i in range(50)}
    pages = _pages(result, budget=300)
    merged: dict[str, Any] = {}
    for page in pages:
        merged.update(page["fields"])
    assert merged == result and list(merged) == list(result)


def test_an_item_over_the_budget_comes_back_shortened_with_a_note() -> None:
    page = recall(COMMITS, budget=300)
    assert page["count"] == 1 and page["next_offset"] == 1
    assert len(result_text(page["items"])) <= 300
    assert page["note"].startswith("item 0 is 1,0")
    assert 'path="[0]"' in page["note"]
    assert recall({"items": COMMITS}, path="items", offset=4, budget=300)["note"] \
        .endswith('path="items[4]"')


def test_recall_of_a_number_returns_it_whole() -> None:
    assert recall({"total": 30}, path="total") == {"path": "total", "type": "value",
                                                    "value": 30}


# -- transform

def test_a_transform_returns_exactly_the_projected_fields() -> None:
    out = transform(COMMITS, "[].{sha: sha, msg: commit.message}")
    assert out == [{"sha": c["sha"], "msg": c["commit"]["message"]} for c in COMMITS]
    assert transform(result_text(COMMITS), "[0].author.login") == "tylerjrbuell"
    assert transform("plain words", "length(@)") == 11


def test_a_bad_expression_raises_a_transform_error_naming_it() -> None:
    with pytest.raises(TransformError) as info:
        transform(COMMITS, "[].{sha: sha")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith('JMESPath expression "[].{sha: sha" is not valid: ')
    assert isinstance(info.value, ValueError)
    with pytest.raises(TransformError, match=r"is not valid: Unknown token '=' at column 4"):
        transform(COMMITS, "[?a = 1]")


def test_an_expression_that_fails_on_the_data_raises_a_transform_error() -> None:
    with pytest.raises(TransformError, match=r'"abs\(@\)" failed: in function abs\(\), '
                       'a value of type array where it takes number'):
        transform(COMMITS, "abs(@)")


def test_a_long_bad_expression_is_clipped_in_the_message() -> None:
    with pytest.raises(TransformError) as info:
        transform(COMMITS, "a." * 200 + "[")
    assert len(str(info.value)) < 300


# -- the budget always holds

_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=60)
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _text,
    lambda inner: st.lists(inner, max_size=8) | st.dictionaries(_text, inner, max_size=8),
    max_leaves=60,
)


def _assert_fits(result: Any, budget: int, items: int = 3, key: str = "_tool_result_1",
                 tool: str = "ns:tool") -> None:
    text = preview(result, key=key, tool=tool, budget=budget, items=items)
    assert len(text) <= budget, text
    assert text.startswith(f"[STORED: {key} | ")
    assert text == preview(result, key=key, tool=tool, budget=budget, items=items)


@settings(max_examples=300, deadline=None)
@given(result=_json, budget=st.integers(MIN_BUDGET, 1500), items=st.integers(0, 6))
def test_any_json_value_previews_within_the_budget(result: Any, budget: int,
                                                   items: int) -> None:
    _assert_fits(result, budget, items)


@settings(max_examples=100, deadline=None)
@given(result=st.lists(_json, max_size=40) | st.dictionaries(_text, _json, max_size=20),
       budget=st.integers(MIN_BUDGET, 900), key=st.text(min_size=1, max_size=64),
       tool=st.text(max_size=300))
def test_any_key_and_tool_name_preview_within_the_budget(result: Any, budget: int, key: str,
                                                         tool: str) -> None:
    _assert_fits(result, budget, key=key, tool=tool)


def _nested(rng: random.Random, depth: int, leaves: list[int]) -> Any:
    """A random value of at most `leaves[0]` leaves (shared, counted down)."""
    roll = rng.random()
    if depth == 0 or roll < 0.2 or leaves[0] <= 0:
        leaves[0] -= 1
        return rng.choice([None, True, 3, -2.5, "x" * rng.randrange(0, 3000),
                           "日本語テキスト" * rng.randrange(1, 200), "e255a5d" * 10])
    if roll < 0.6:
        return [_nested(rng, depth - 1, leaves) for _ in range(rng.randrange(0, 50))]
    key = rng.choice(["k", "a key with spaces", "ключ", "K" * 2000, "x.y", ""])
    return {f"{key}{i}": _nested(rng, depth - 1, leaves) for i in range(rng.randrange(0, 12))}


def test_deep_huge_and_unicode_results_preview_within_every_budget() -> None:
    rng = random.Random(3)
    shapes: list[Any] = [[], {}, "", [[]] * 500, COMMITS, {"items": COMMITS},
                         {"a": {"b": {"c": {"d": {"e": {"f": {"g": COMMITS}}}}}}},
                         [{"K" * 5000: "v" * 5000}] * 10, ["😀" * 4000],
                         {"content": [{"type": "image", "data": "QUJD" * 30000,
                                       "mimeType": "image/" + "x" * 500}] * 40}]
    shapes += [_nested(rng, 8, [300]) for _ in range(80)]
    for result in shapes:
        for budget in (200, 201, 257, 400, 800, 1200):
            _assert_fits(result, budget)
            _assert_fits(result, budget, items=0, key="k" * 64, tool="t" * 400)


@settings(max_examples=150, deadline=None)
@given(result=_json | _json.map(result_text), budget=st.integers(MIN_BUDGET, 600))
def test_recall_pages_of_any_value_reassemble_it(result: Any, budget: int) -> None:
    pages = _pages(result, budget=budget)
    if isinstance(result, str) and result.lstrip()[:1] in ("[", "{"):
        try:
            result = msgspec.json.decode(result)  # JSON text is recalled as its value
        except msgspec.DecodeError:
            pass
    first = pages[0]
    if first["type"] == "value":
        assert first["value"] == result
    elif any("note" in page for page in pages):
        assert all(page["count"] == 1 for page in pages if "note" in page)
    elif first["type"] == "array":
        assert [item for page in pages for item in page["items"]] == result
    elif first["type"] == "object":
        merged: dict[str, Any] = {}
        for page in pages:
            merged.update(page["fields"])
        assert merged == result
    else:
        assert "".join(page["text"] for page in pages) == result
    for page in pages:
        body = page.get("items", page.get("fields"))
        if body is not None:
            assert len(result_text(body)) <= budget


@pytest.mark.parametrize("expression", [
    "@" + "|[@,@]" * 30,  # shared references: a tree of 2**30 copies once encoded
    "@" + "|[@,@]" * 30 + "|to_string(@)",  # ... encoded inside the expression
    "[@,@]" + "|[@,@]" * 25 + "|[]" * 25,  # ... flattened into one huge list
    "join(',', " + "[@,@][]|" * 40 + "[].sha)",
    # A function called once per element of a projection over shared references: each
    # call was measured against a fresh budget (71 s, and minutes with one more `@`).
    " | ".join(["[" + ",".join("@" * 16) + "]"] * 6) + " | [@] | [] | [] | [] | "
    "[*].length(to_string(@))",
    # ... a text scanned once per reference to it.
    "[0].commit.message | " + " | ".join(["[" + ",".join("@" * 16) + "]"] * 4) +
    " | [] | [] | [] | [*].contains(@, 'zz')",
    # ... or compared whole, with itself or another.
    "[0].commit.message | " + " | ".join(["[" + ",".join("@" * 16) + "]"] * 4) +
    " | [] | [] | [] | [*].starts_with(@, @)",
    "[@, @] | " + " | ".join(["[" + ",".join("@" * 16) + "]"] * 3) +
    " | [] | [] | [*].[[0] == [1]]",
])
def test_an_expression_that_would_blow_up_is_refused_quickly(expression: str) -> None:
    import time

    start = time.perf_counter()
    with pytest.raises(TransformError, match="select less"):
        transform(COMMITS, expression)
    with pytest.raises(TransformError):
        recall(COMMITS, path=expression)
    assert time.perf_counter() - start < 5


def test_a_flatten_is_charged_before_its_list_is_built() -> None:
    # 100 references to a large array, flattened: the whole list was built (gigabytes
    # for a few million elements) before its length was counted.
    with pytest.raises(TransformError, match="steps"):
        transform(list(range(300_000)), "[" + ",".join("@" * 100) + "] | []")


def test_filters_and_functions_over_a_large_result_are_not_refused() -> None:
    # What `_transform` is for: narrowing a large result. Charging what functions read
    # to the 4M characters a value may build refused these.
    bodies = [{"id": i, "body": "x" * 1000 + ("refund" if i % 100 == 0 else "")}
              for i in range(5000)]
    assert transform(bodies, "[?contains(body, `\"refund\"`)].id") == \
        list(range(0, 5000, 100))
    assert transform({"xs": list(range(150_000))}, "max(xs)") == 149_999
    assert transform(bodies, "[?starts_with(body, 'xxx')] | length(@)") == 5000


def test_a_type_error_names_the_types_not_the_value() -> None:
    """jmespath's own message writes the whole value out: shared references to a large
    text, nested, are gigabytes once written."""
    many = "text | " + " | ".join(["[" + ",".join("@" * 16) + "]"] * 4)
    with pytest.raises(TransformError) as caught:
        transform({"text": "y" * 100_000}, many + " | starts_with(@, 'y')")
    assert "in function starts_with(), a value of type array where it takes string" in \
        str(caught.value)
    assert len(str(caught.value)) < 1000


def test_an_expression_nested_too_deeply_is_a_transform_error() -> None:
    with pytest.raises(TransformError, match="nests too deeply"):
        transform(COMMITS, "!" * 900 + "@")
    deep = "[" * 5000 + "]" * 5000  # JSON text too deep to decode is kept as text
    assert recall(deep)["type"] == "text"
