"""The tool model: validation, the JSON Schema form of a spec, the manifest, provider
formats. Pure functions, no bus."""

from __future__ import annotations

import json
import re

import jsonschema_rs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas.errors import ConfigError, InvalidRequestError, ManifestError
from schemas.manifest import parse_manifest
from schemas.providers import (
    GEMINI_SCHEMA_KEYS,
    NAME_PATTERNS,
    ProviderNames,
    compose_schema,
    export,
    provider_name,
)
from schemas.requests import parse_request
from schemas.tools import Annotations, ToolSpec, from_tool_schema, to_tool_schema
from schemas.validation import Validator

TEN_FIELDS = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "format": "email"},
        "kind": {"type": "string", "enum": ["a", "b"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "limit": {"type": "integer", "default": 10},
        "opts": {"type": "object", "properties": {"deep": {"type": "boolean", "default": False}}},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_every_violation_is_listed_with_its_json_path() -> None:
    v = Validator(TEN_FIELDS)
    _, problems = v.check({"name": "", "age": -3, "email": "not-an-email", "kind": "z",
                           "tags": ["ok", 7], "surprise": 1})
    by_path = {p.path: p.message for p in problems}
    assert set(by_path) == {"$.name", "$.age", "$.email", "$.kind", "$.tags[1]", "$"}
    assert "surprise" in by_path["$"]  # additionalProperties names the stray key
    assert "minimum" in by_path["$.age"] and '"a"' in by_path["$.kind"]
    _, missing = v.check({})
    assert {p.message for p in missing} == {'"name" is a required property',
                                            '"age" is a required property'}


def test_defaults_are_filled_in_without_touching_the_callers_dict() -> None:
    v = Validator(TEN_FIELDS)
    given_args = {"name": "a", "age": 1, "opts": {}}
    filled, problems = v.check(given_args)
    assert not problems
    assert filled == {"name": "a", "age": 1, "limit": 10, "opts": {"deep": False}}
    assert given_args == {"name": "a", "age": 1, "opts": {}}


def test_an_unusable_schema_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="invalid JSON Schema"):
        Validator({"type": "no-such-type"})


@pytest.mark.parametrize("ref", ["http://127.0.0.1:9/schema.json", "file:///etc/passwd"])
def test_a_schema_that_refers_outside_itself_is_refused_never_fetched(ref: str) -> None:
    # A client's think schema, an MCP server's tool or a manifest may say this: fetching
    # would read local files and reach hosts on toolbus's network, from its event loop.
    with pytest.raises(ConfigError, match="Retrieval is disabled"):
        Validator({"type": "object", "properties": {"a": {"$ref": ref}}})
    with pytest.raises(InvalidRequestError, match="Retrieval is disabled") as info:
        parse_request(b'{"message": "hi", "think": {"id": "a", "instruction": "x", '
                      b'"output_schema": {"$ref": "' + ref.encode() + b'"}}}')
    assert "\n" not in str(info.value)
    # What a schema holds itself, and the meta-schemas, still resolve.
    local = Validator({"$defs": {"a": {"type": "string"}}, "$ref": "#/$defs/a"})
    assert local.violations("x") == [] and local.violations(1)


def _doubling(levels: int, combinator: str) -> dict:
    """Each definition names the next from two branches: 2 KB, 2**levels paths."""
    defs = {f"a{i}": {combinator: [{"$ref": f"#/$defs/a{i + 1}"},
                                   {"$ref": f"#/$defs/a{i + 1}", "minimum": -i - 1}]}
            for i in range(levels)}
    return {"$defs": {**defs, f"a{levels}": {"type": "integer"}}, "$ref": "#/$defs/a0"}


# Two branches that both go on to the same place in the value, level after level.
_DOUBLING_PER_LEVEL = {"$defs": {"n": {"anyOf": [
    {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}},
    {"type": "object", "minProperties": 1, "properties": {"c": {"$ref": "#/$defs/n"}}}]}},
    "$ref": "#/$defs/n"}


@pytest.mark.parametrize("schema", [_doubling(30, "oneOf"), _doubling(30, "anyOf"),
                                    _doubling(30, "allOf"), _DOUBLING_PER_LEVEL],
                         ids=["oneOf", "anyOf", "allOf", "per-level"])
def test_a_schema_whose_checks_multiply_is_refused_before_any_value_is_checked(
        schema: dict) -> None:
    # A client's think schema of 2.4 KB like the first kept the planner's process (and
    # with it the gateway and the session actor of `toolbus up`) busy for good, growing by
    # gigabytes, once the model answered: jsonschema-rs walks every path.
    with pytest.raises(ConfigError, match="too costly to check"):
        Validator(schema)
    body = {"message": "hi", "think": {"id": "t", "instruction": "x",
                                       "output_schema": schema}}
    with pytest.raises(InvalidRequestError, match=r"think\[0\]\.output_schema: .*too "
                                                  "costly"):
        parse_request(json.dumps(body).encode())
    # A manifest's is refused at boot, naming its key path, not when the planner starts.
    manifest = {"agent_config": {"output_schema": schema}}
    with pytest.raises(ManifestError, match=r"agent_config.output_schema: .*too costly"):
        parse_manifest(json.dumps(manifest), env={})


def test_recursive_and_shared_definitions_stay_usable() -> None:
    tree = {"$defs": {"node": {"type": "object", "properties": {
        "left": {"$ref": "#/$defs/node"}, "right": {"$ref": "#/$defs/node"},
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"}
    deep: dict = {}
    for _ in range(60):
        deep = {"left": deep, "right": {"children": [deep]}}
    assert Validator(tree).violations(deep) == []
    assert Validator(tree).violations({"left": {"right": 1}})
    person = {"type": "object", "properties": {"home": {"$ref": "#/$defs/address"},
                                               "work": {"$ref": "#/$defs/address"}}}
    shared = {"$defs": {"address": {"type": "object", "properties": {
        "street": {"type": "string"}}}, "person": person},
        "type": "object", "properties": {f"p{i}": {"$ref": "#/$defs/person"}
                                         for i in range(200)}}
    assert Validator(shared).violations({"p1": {"home": {"street": 1}}})
    assert Validator(_doubling(8, "anyOf")).violations(1) == []
    # One large definition named from many places is counted once, not once per place.
    many = {"$defs": {"n": {"anyOf": [{"minimum": i} for i in range(2000)]}},
            "properties": {f"p{i}": {"$ref": "#/$defs/n", "maximum": i}
                           for i in range(2000)}}
    assert Validator(many).violations({"p7": 5}) == []
    # References are followed as jsonschema-rs follows them: within a resource of any
    # scheme, by anchor; a "$id" where no schema is (an enum's value) is no resource.
    for schema in ({"$id": "urn:x", "$defs": {"b": {"$id": "urn:y", "$defs": {"c": {}},
                                                     "$ref": "#/$defs/c"}}, "$ref": "urn:y"},
                   {"$defs": {"a": {"$anchor": "x", "type": "string"}}, "$ref": "#x"},
                   {"enum": [{"$id": "http://[::1"}]}):
        assert Validator(schema).violations(1) is not None


def test_a_spec_round_trips_through_its_json_schema_form() -> None:
    spec = ToolSpec(name="shop:add", description="Add.", parameters=TEN_FIELDS,
                    output={"type": "object"}, risk_level="medium", timeout_ms=5000,
                    requires_approval=True, source="python:shop", pools=["default", "gpu"],
                    annotations=Annotations(readOnlyHint=False, idempotentHint=True))
    form = to_tool_schema(spec)
    assert form["_tool"] == "shop:add" and form["properties"] == TEN_FIELDS["properties"]
    assert form["_annotations"]["idempotentHint"] is True
    assert from_tool_schema(form) == spec


def test_the_seed_001_form_with_tool_and_output_as_properties_is_read() -> None:
    spec = from_tool_schema({
        "type": "object", "description": "Analyzes text sentiment",
        "properties": {"_tool": {"type": "string", "const": "nlp:sentiment"},
                       "text": {"type": "string"},
                       "_output": {"type": "object", "properties": {"sentiment": {}}}},
        "readOnlyHint": True,
    })
    assert spec.name == "nlp:sentiment" and list(spec.parameters["properties"]) == ["text"]
    assert spec.output == {"type": "object", "properties": {"sentiment": {}}}
    assert spec.annotations.readOnlyHint
    with pytest.raises(ConfigError, match="_risk_level"):
        from_tool_schema({"_tool": "a:b", "_risk_level": "extreme"})
    with pytest.raises(ConfigError, match="_tool"):
        from_tool_schema({"properties": {}})


def test_call_meta_fields_are_parsed_and_checked() -> None:
    req = parse_request(
        b'{"calls": [{"tool": "a:b", "arguments": {}, "_reasoningForCall": "why",'
        b' "_outputPath": "customer.profile", "_delegate": "gpu", "_instance": "box-1"},'
        b' {"_tool": "a:c", "x": 1, "_outputPath": "c"}]}')
    first, flat = req.calls
    assert (first.reasoning, first.output_path, first.delegate, first.instance) == (
        "why", "customer.profile", "gpu", "box-1")
    assert (flat.tool, flat.arguments, flat.output_path) == ("a:c", {"x": 1}, "c")
    from schemas.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=r"calls\[0\]._outputPath"):
        parse_request(b'{"calls": [{"tool": "a:b", "_outputPath": "a..b"}]}')
    with pytest.raises(InvalidRequestError, match=r"calls\[0\]._delegate"):
        parse_request(b'{"calls": [{"tool": "a:b", "_delegate": "no spaces"}]}')
    with pytest.raises(InvalidRequestError, match="_whatever"):
        parse_request(b'{"calls": [{"_tool": "a:b", "_whatever": 1}]}')


# --- manifest ------------------------------------------------------------------------------

MANIFEST = """
version: 1
pools:
  sandbox: {description: isolated}
tools:
  http:
    - name: tickets:create_ticket
      description: Open a ticket.
      base_url: ${TICKETS_URL}
      allowed_methods: [POST, GET]
      default_headers: {Authorization: "Bearer ${TICKETS_TOKEN:-none}"}
  code: {pool: sandbox}
  files: {root: ./work}
"""


def test_manifest_resolves_variables_and_fills_documented_defaults() -> None:
    m = parse_manifest(MANIFEST, env={"TICKETS_URL": "http://127.0.0.1:9"})
    h = m.tools.http[0]
    assert h.base_url == "http://127.0.0.1:9"
    assert h.default_headers == {"Authorization": "Bearer none"}
    assert (h.timeout_ms, h.response_format, h.max_response_chars, h.auto_approve) == (
        10_000, "auto", 20_000, False)
    assert m.tools.code is not None and m.tools.code.pool == "sandbox"
    assert m.pools_used() == ["default", "sandbox"]
    assert parse_manifest("tools: {http: [{name: 'a:b'}]}", env={}).tools.http[0] \
        .allowed_methods == ["GET", "HEAD"]


def test_a_missing_variable_is_named_with_its_key_path() -> None:
    with pytest.raises(ManifestError) as err:
        parse_manifest(MANIFEST, env={})
    assert "tools.http[0].base_url: ${TICKETS_URL} is not set" in str(err.value)


def test_manifest_errors_name_the_key_path() -> None:
    bad = """
tools:
  http:
    - name: tickets:create
      allowed_methods: [GET, FETCH]
      timeout_ms: -1
  code: {pool: gpu}
"""
    with pytest.raises(ManifestError) as err:
        parse_manifest(bad, env={})
    text = str(err.value)
    assert "tools.http[0].allowed_methods[1]" in text and "tools.http[0].timeout_ms" in text
    with pytest.raises(ManifestError, match=r"tools.code.pool: pool 'gpu' is not declared"):
        parse_manifest("tools: {code: {pool: gpu}}", env={})
    with pytest.raises(ManifestError, match=r"tools.http\[0\].name"):
        parse_manifest("tools: {http: [{name: no-namespace}]}", env={})
    with pytest.raises(ManifestError, match=r"Extra inputs are not permitted"):
        parse_manifest("tools: {htp: []}", env={})
    with pytest.raises(ManifestError, match="not valid YAML"):
        parse_manifest("tools: [", env={})


def test_a_key_written_twice_is_an_error_naming_it_not_the_first_dropped() -> None:
    # PyYAML alone keeps the last `builtins` and serves echo no more, without a word.
    twice = "version: 1\ntools:\n  builtins: [echo]\n  builtins: [current_time]\n"
    with pytest.raises(ManifestError, match=r"found the key 'builtins' a second time") as err:
        parse_manifest(twice, env={})
    assert "line 4, column 3" in str(err.value)
    # A merge key may still be overridden, as YAML means it.
    merged = parse_manifest("version: 1\ntools:\n  http:\n"
                            "    - &t {name: 'a:b', base_url: 'http://127.0.0.1:1'}\n"
                            "    - {<<: *t, name: 'a:c'}\n", env={})
    assert [t.name for t in merged.tools.http] == ["a:b", "a:c"]


# --- provider formats ------------------------------------------------------------------------

_part = st.from_regex(r"[A-Za-z0-9_-]{1,40}", fullmatch=True)


@given(ns=_part, tool=_part)
def test_provider_names_match_each_pattern_and_map_back(ns: str, tool: str) -> None:
    name = f"{ns}:{tool}"
    for fmt, pattern in NAME_PATTERNS.items():
        names = ProviderNames([name, "built-in:echo"], fmt)
        encoded = names.encode(name)
        assert pattern.fullmatch(encoded), (fmt, encoded)
        assert names.decode(encoded) == name


def test_simple_names_decode_without_the_table() -> None:
    assert provider_name("built-in:echo", "openai") == "built-in__echo"
    assert provider_name("built-in:echo", "mcp") == "built-in.echo"
    assert ProviderNames([], "anthropic").decode("tickets__create_ticket") == \
        "tickets:create_ticket"
    with pytest.raises(ConfigError, match="not a openai tool name"):
        ProviderNames([], "openai").decode("nonsense")


SPECS = [
    ToolSpec(name="built-in:echo", description="Echo.",
             parameters={"type": "object", "additionalProperties": True}),
    ToolSpec(name="shop:order", description="Order.", output={"type": "object"},
             parameters={
                 "type": "object",
                 "properties": {
                     "item": {"$ref": "#/$defs/Item"},
                     "note": {"type": ["string", "null"]},
                     "mode": {"const": "fast"},
                 },
                 "required": ["item"],
                 "additionalProperties": False,
                 "$defs": {"Item": {"type": "object", "properties": {"sku": {"type": "string"}},
                                    "required": ["sku"]}},
             }),
]


def _walk(schema: object):  # every nested schema object
    if isinstance(schema, dict):
        yield schema
        for key in ("properties",):
            for sub in schema.get(key, {}).values():
                yield from _walk(sub)
        for key in ("items",):
            if key in schema:
                yield from _walk(schema[key])
        for sub in schema.get("anyOf", []):
            yield from _walk(sub)


def test_openai_and_anthropic_exports_follow_their_documented_shapes() -> None:
    openai, _ = export(SPECS, "openai")
    for tool in openai:
        assert tool["type"] == "function"
        fn = tool["function"]
        assert NAME_PATTERNS["openai"].fullmatch(fn["name"])
        assert fn["parameters"]["type"] == "object"
        assert "$ref" not in str(fn["parameters"])  # refs are inlined
        jsonschema_rs.validator_for(fn["parameters"])  # still a valid JSON Schema
    anthropic, _ = export(SPECS, "anthropic")
    assert {t["name"] for t in anthropic} == {"built-in__echo", "shop__order"}
    assert all(t["input_schema"]["type"] == "object" for t in anthropic)


def test_gemini_declarations_use_only_the_openapi_subset() -> None:
    (gemini,), names = export(SPECS, "gemini")
    decls = gemini["functionDeclarations"]
    order = next(d for d in decls if names.decode(d["name"]) == "shop:order")
    for node in _walk(order["parameters"]):
        assert set(node) <= GEMINI_SCHEMA_KEYS, set(node) - GEMINI_SCHEMA_KEYS
    props = order["parameters"]["properties"]
    assert props["note"] == {"type": "string", "nullable": True}
    assert props["mode"] == {"enum": ["fast"]}
    assert props["item"]["properties"]["sku"] == {"type": "string"}


def test_mcp_tools_list_page_carries_schemas_and_annotations() -> None:
    page, names = export(SPECS, "mcp")
    order = next(t for t in page["tools"] if t["name"] == "shop.order")
    assert order["inputSchema"]["type"] == "object"
    assert order["outputSchema"] == {"type": "object"}
    assert set(order["annotations"]) == {"readOnlyHint", "destructiveHint",
                                         "idempotentHint", "openWorldHint"}
    assert names.decode("shop.order") == "shop:order"


def test_the_composed_schema_accepts_calls_or_output_and_toolbus_reads_the_answer() -> None:
    composed = compose_schema(SPECS, {"type": "object",
                                      "properties": {"summary": {"type": "string"}},
                                      "required": ["summary"]})
    v = jsonschema_rs.validator_for(composed)
    answer = {"output": None, "calls": [
        {"_tool": "shop:order", "_reasoningForCall": "user asked", "item": {"sku": "A1"}}]}
    assert v.is_valid(answer)
    assert v.is_valid({"output": {"summary": "done"}, "calls": []})
    assert not v.is_valid({"output": {"summary": "x", "extra": 1}, "calls": []})
    assert not v.is_valid({"output": None, "calls": [{"_tool": "shop:order"}]})  # no item
    import msgspec

    req = parse_request(msgspec.json.encode({"calls": answer["calls"]}))
    assert req.calls[0].tool == "shop:order" and req.calls[0].arguments == {"item": {"sku": "A1"}}
    assert req.calls[0].reasoning == "user asked"


def test_mcp_entries_follow_seed_000_and_name_what_is_wrong() -> None:
    m = parse_manifest("""
mcps:
  - {id: cars, hostname: "http://cars-mcp", port: 8765, api_key: "${KEY}"}
  - {id: legacy, transport: sse, hostname: "https://tools.example.com", port: 443,
     headers: {X-Tenant: acme}}
  - {id: local, transport: stdio, command: python3, args: [-m, srv], env: {A: "1"}}
  - {id: custom, hostname: "http://h", port: 1, path: /v2/mcp}
""", env={"KEY": "s3cret"})
    cars, legacy, local, custom = m.mcps
    assert cars.url == "http://cars-mcp:8765/mcp" and cars.transport == "streamable-http"
    assert cars.http_headers == {"Authorization": "Bearer s3cret"}
    assert "s3cret" not in cars.describe()
    assert legacy.url == "https://tools.example.com:443/sse"
    assert legacy.http_headers == {"X-Tenant": "acme"}
    assert local.url is None and local.describe() == "stdio command python3 -m srv"
    assert custom.url == "http://h:1/v2/mcp"
    for bad, why in [
        ("{id: a, hostname: 'http://h/mcp', port: 1}", "contains a path"),
        ("{id: a, hostname: 'http://h:80', port: 1}", "contains a port"),
        ("{id: a, hostname: 'http://h?x=1', port: 1}", "contains a query"),
        ("{id: a, hostname: 'h', port: 1}", "must start with http:// or https://"),
        ("{id: a, hostname: 'http://h'}", "needs hostname and port"),
        ("{id: a, transport: stdio}", "needs command"),
        ("{id: a, transport: stdio, command: x, port: 1}", "do not apply to a stdio server"),
        ("{id: 'a b', hostname: 'http://h', port: 1}", "invalid tool namespace"),
        ("{id: a, hostname: 'http://h', port: 70000}", "mcps[0].port"),
    ]:
        with pytest.raises(ManifestError, match=re.escape(why)):
            parse_manifest(f"mcps: [{bad}]", env={})
    with pytest.raises(ManifestError, match="two MCP servers have the id a"):
        parse_manifest("mcps: [{id: a, transport: stdio, command: x},"
                       " {id: a, transport: stdio, command: y}]", env={})
