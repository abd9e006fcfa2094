"""The manifest's agent section, `agent_config:` (seed 000): its snippets load unchanged,
every field is checked where it is written, and secrets come only from `${VAR}`."""

from __future__ import annotations

import re

import pytest

from schemas.errors import ConfigError, ManifestError
from schemas.manifest import PLANNER_TOOLS, Manifest, parse_manifest, unknown_tool_refs
from services.config import tool_secrets
from tests.conftest import REPO

# Seed 000, "The model": verbatim.
SEED_MCPS = """\
agent_config:
  mcps:
    - id: cars
      hostname: http://cars-mcp
      port: 8765
      transport: streamable-http
    - id: crm
      hostname: https://crm-tools.internal.example.com
      port: 443
      transport: streamable-http
      api_key: ${CRM_MCP_KEY}
"""

# Seed 000, "Reevaluation tools": verbatim.
SEED_REEVALUATION = """\
agent_config:
  context:
    reevaluation_tools:
      - id: crm:authenticate_customer
      - id: crm:get_account_status
"""

MODEL = "model: {provider: openai, model: gpt-4o-mini, api_key: '${OPENAI_API_KEY}'}"


def problems_of(text: str, **env: str) -> str:
    with pytest.raises(ManifestError) as info:
        parse_manifest(text, env=env)
    return str(info.value)


def test_seed_000_mcps_snippet_loads_unchanged_and_sends_its_key_as_a_bearer() -> None:
    m = parse_manifest(SEED_MCPS, env={"CRM_MCP_KEY": "crm-s3cret"})
    cars, crm = m.agent_config.mcps
    assert [s.id for s in m.mcps] == ["cars", "crm"]  # what the connector runs
    assert cars.url == "http://cars-mcp:8765/mcp" and cars.http_headers == {}
    assert crm.url == "https://crm-tools.internal.example.com:443/mcp"
    assert crm.http_headers == {"Authorization": "Bearer crm-s3cret"}
    assert "crm-s3cret" not in crm.describe()


def test_seed_000_reevaluation_snippet_loads_unchanged() -> None:
    m = parse_manifest(SEED_REEVALUATION, env={})
    assert [r.id for r in m.agent_config.context.reevaluation_tools] == [
        "crm:authenticate_customer", "crm:get_account_status"]
    assert m.mcps == []  # the servers are checked at boot, when they list their tools


def test_both_seed_snippets_load_together_in_one_section() -> None:
    both = SEED_MCPS + SEED_REEVALUATION.removeprefix("agent_config:\n")
    m = parse_manifest(both, env={"CRM_MCP_KEY": "k"})
    assert [s.id for s in m.mcps] == ["cars", "crm"]
    assert len(m.agent_config.context.reevaluation_tools) == 2


def test_the_agent_section_has_documented_defaults() -> None:
    a = parse_manifest(f"agent_config: {{{MODEL}}}", env={"OPENAI_API_KEY": "sk-x"}).agent_config
    assert a.model is not None
    assert (a.model.timeout_s, a.model.max_retries, a.model.base_url) == (60.0, 4, None)
    assert a.mode == "native" and a.instructions == "" and a.output_schema is None
    assert (a.limits.max_iterations, a.limits.max_reevaluations,
            a.limits.max_argument_retries, a.limits.max_tokens_per_turn) == (25, 3, 2, None)
    assert a.policies == [] and a.think == [] and a.agents == {}
    assert "sk-x" not in repr(a)  # a key never shows in a repr or a log line
    assert parse_manifest("", env={}).agent_config.model is None


def test_every_field_of_the_section_loads() -> None:
    text = f"""
agent_config:
  {MODEL}
  instructions: Be brief.
  output_schema: {{type: object, properties: {{answer: {{type: string}}}}, required: [answer]}}
  mode: composed
  limits: {{max_iterations: 5, max_reevaluations: 1, max_tokens_per_turn: 9000,
           max_argument_retries: 0}}
  think:
    - {{id: intent, instruction: Classify the request., output_schema: {{type: object}}}}
  policies:
    - id: auth_first
      when_state: "!customer.authenticated"
      action: Authenticate the customer before anything else.
      tools: [crm:authenticate_customer]
      reevaluate_after: [crm:authenticate_customer, {{id: crm:get_account_status}}]
    - id: always_polite
      action: Thank the customer.
    - id: refunds
      when: the customer asks for a refund
      action: Hand the case to the billing agent.
      tools: [agent:billing, built-in:emit_output]
      think: {{id: refund_reason, instruction: Name the reason., output_schema: {{type: string}}}}
  agents:
    billing:
      instructions: You handle refunds.
      tools: ["crm:*", built-in:current_time]
      model: {{provider: anthropic, model: claude-haiku-4-5, api_key: "${{ANTHROPIC_API_KEY:-}}",
              base_url: "http://127.0.0.1:8080/", temperature: 0, max_tokens: 512}}
"""
    a = parse_manifest(text, env={"OPENAI_API_KEY": "sk-x"}).agent_config
    assert a.mode == "composed" and a.limits.max_tokens_per_turn == 9000
    auth, polite, refunds = a.policies
    assert auth.when is None and auth.when_state == "!customer.authenticated"
    assert auth.reevaluate_after == ["crm:authenticate_customer", "crm:get_account_status"]
    assert polite.when is None and polite.when_state is None  # applies always
    assert refunds.think is not None and refunds.think.id == "refund_reason"
    billing = a.agents["billing"].model
    assert billing is not None and billing.provider == "anthropic"
    assert billing.api_key is None  # `${VAR:-}`: no key, for a local server
    assert billing.base_url == "http://127.0.0.1:8080"


@pytest.mark.parametrize(("text", "path"), [
    ("agent_config: {modle: x}", "agent_config.modle"),
    ("agent_config: {model: {provider: openai, model: m, temprature: 1}}",
     "agent_config.model.temprature"),
    ("agent_config: {context: {reevaluation_tool: []}}", "agent_config.context.reevaluation_tool"),
    ("agent_config: {context: {reevaluation_tools: [{id: a:b, scope: x}]}}",
     "agent_config.context.reevaluation_tools[0].scope"),
    ("agent_config: {limits: {max_steps: 3}}", "agent_config.limits.max_steps"),
    ("agent_config: {policies: [{id: p, action: a, tool: [a:b]}]}",
     "agent_config.policies[0].tool"),
    ("agent_config: {think: [{id: t, instruction: i, output_schema: {}, model: m}]}",
     "agent_config.think[0].model"),
    ("agent_config: {mcps: [{id: a, hostname: 'http://h', port: 1, apikey: x}]}",
     "agent_config.mcps[0].apikey"),
])
def test_an_unknown_key_fails_with_its_key_path(text: str, path: str) -> None:
    assert f"{path}: Extra inputs are not permitted" in problems_of(text)


@pytest.mark.parametrize(("text", "path"), [
    ("agent_config: {model: {provider: openai, model: m, api_key: sk-live-123}}",
     "agent_config.model.api_key"),
    ("agent_config: {model: {provider: openai, model: m, api_key: 'Bearer ${K}'}}",
     "agent_config.model.api_key"),
    ("agent_config: {model: {provider: openai, model: m, api_key: '${K:-sk-live-123}'}}",
     "agent_config.model.api_key"),
    ("agent_config: {agents: {a: {instructions: i, model: {provider: gemini, model: m,"
     " api_key: sk-live-123}}}}", "agent_config.agents.a.model.api_key"),
    ("agent_config: {mcps: [{id: crm, hostname: 'http://h', port: 1, api_key: sk-live-123}]}",
     "agent_config.mcps[0].api_key"),
])
def test_a_key_written_in_the_manifest_is_refused(text: str, path: str) -> None:
    message = problems_of(text, K="v")
    assert f"{path}: a key written in the manifest is refused" in message
    assert "${VAR_NAME}" in message and "sk-live-123" not in message


@pytest.mark.parametrize(("base_url", "path"), [
    ("http://proxy:s3cretpw@127.0.0.1:8080/v1", "agent_config.model.base_url"),
    ("https://:s3cretpw@h/v1", "agent_config.model.base_url"),
    ("ftp://u:s3cretpw@h/v1", "agent_config.model.base_url"),
])
def test_a_base_url_with_a_password_is_refused_without_quoting_it(base_url: str,
                                                                 path: str) -> None:
    # `toolbus up` printed it whole ("planner: openai m at http://proxy:s3cretpw@..."), and
    # httpx sends it as Basic auth, which a proxy's 401 echoed into turn.failed.
    for text in (f"agent_config: {{model: {{provider: openai, model: m, base_url: '{base_url}'}}}}",
                 "agent_config: {model: {provider: openai, model: m, base_url: '${URL}'}}"):
        message = problems_of(text, URL=base_url)
        assert f"{path}: " in message and "s3cretpw" not in message, message
    agent = ("agent_config: {agents: {a: {instructions: i, model: {provider: openai, model: m,"
             f" base_url: '{base_url}'}}}}}}}}")
    message = problems_of(agent)
    assert "agent_config.agents.a.model.base_url" in message and "s3cretpw" not in message
    # An HTTP tool's base_url too (it loaded, then failed every call).
    tool = f"tools: {{http: [{{name: 'api:get', base_url: '{base_url}'}}]}}"
    message = problems_of(tool)
    assert "base_url must not carry credentials" in message and "s3cretpw" not in message
    assert "default_headers" in message, message


def test_a_model_base_url_with_a_query_is_refused_without_quoting_it() -> None:
    # Google's documented `?key=`: printed whole at `toolbus up`'s start, and the API's
    # path then went after the query.
    text = ("agent_config: {model: {provider: gemini, model: m, base_url: "
            "'https://generativelanguage.googleapis.com/v1beta?key=${GEMINI_KEY}'}}")
    message = problems_of(text, GEMINI_KEY="AIzaSECRETSECRET")
    assert "agent_config.model.base_url: " in message and "must not have a query" in message
    assert "SECRET" not in message, message
    assert "must not have a query" in problems_of(
        "agent_config: {model: {provider: openai, model: m, base_url: 'http://h/v1#x'}}")


def test_a_key_read_from_a_file_loses_its_line_end_and_a_broken_one_is_refused_unquoted(
        ) -> None:
    got = parse_manifest(f"agent_config: {{{MODEL}}}", env={"OPENAI_API_KEY": "sk-abc\r\n"})
    assert got.agent_config is not None and got.agent_config.model is not None
    assert got.agent_config.model.api_key == "sk-abc"
    got = parse_manifest(SEED_MCPS, env={"CRM_MCP_KEY": " crm-key \n"})
    assert got.agent_config is not None
    assert [m.api_key for m in got.agent_config.mcps] == [None, "crm-key"]
    # Inside the key, no header may carry it: every request would fail, and the HTTP
    # library's error would quote it whole.
    for broken in ("sk-NL\nSECRET-9", "sk-two words", "sk-\x00nul", "sk-clé"):
        message = problems_of(f"agent_config: {{{MODEL}}}", OPENAI_API_KEY=broken)
        assert "agent_config.model.api_key: " in message and "no HTTP header" in message
        assert all(part not in message for part in ("SECRET", "words", "nul", "clé")), \
            message


def test_a_header_value_with_a_line_break_is_refused_naming_the_header_only() -> None:
    text = ("agent_config: {mcps: [{id: crm, hostname: 'http://h', port: 1, "
            "headers: {X-Tenant: '${TENANT}'}}]}")
    message = problems_of(text, TENANT="acme\r\nX-Injected: SECRET")
    assert "header X-Tenant: its value holds a line break" in message
    assert "SECRET" not in message and "acme" not in message
    got = parse_manifest(text, env={"TENANT": " acme "})
    assert got.agent_config is not None and got.agent_config.mcps[0].headers == {
        "X-Tenant": "acme"}


def test_a_tool_key_from_the_environment_is_checked_as_a_manifest_key(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TAVILY_API_KEY", "tvly-abc\r\n")
    assert tool_secrets() == {"TAVILY_API_KEY": "tvly-abc"}
    monkeypatch.setenv("TAVILY_API_KEY", "tvly-a\nSECRET")
    with pytest.raises(ConfigError, match=r"\$TAVILY_API_KEY: the key holds") as info:
        tool_secrets()
    assert "SECRET" not in str(info.value)


def test_a_missing_variable_is_named_with_its_key_path() -> None:
    message = problems_of(f"agent_config: {{{MODEL}}}")
    assert "agent_config.model.api_key: ${OPENAI_API_KEY} is not set in the environment" \
        in message
    # What it suggests for a key is accepted: no default written in the file, none at all.
    assert "write ${OPENAI_API_KEY:-} for a server that takes no key" in message
    keyless = parse_manifest(
        f"agent_config: {{{MODEL.replace('${OPENAI_API_KEY}', '${OPENAI_API_KEY:-}')}}}",
        env={})
    assert keyless.agent_config is not None
    assert "${CRM_MCP_KEY} is not set" in problems_of(SEED_MCPS)
    assert "${PORT} is not set in the environment; export PORT=... or write " \
        "${PORT:-default}" in problems_of("mcps: [{id: a, hostname: http://h, port: '${PORT}'}]")


def test_a_policy_gives_when_or_when_state_not_both() -> None:
    message = problems_of("agent_config: {policies: [{id: p, action: a, when: always,"
                          " when_state: 'a.b'}]}")
    assert "agent_config.policies[0]:" in message
    assert "give when (natural language) or when_state" in message
    bad = problems_of("agent_config: {policies: [{id: p, action: a, when_state: 'a.['}]}")
    assert "agent_config.policies[0].when_state:" in bad and "not a JMESPath expression" in bad


@pytest.mark.parametrize("expression", ["(" * 5000 + "a" + ")" * 5000,
                                        "!" * 20000 + "a",
                                        "`" + "[" * 5000 + "]" * 5000 + "`"])
def test_a_when_state_nested_too_deeply_is_refused_naming_its_key(expression: str) -> None:
    # JMESPath's parser recurses per level: `toolbus up` died with a RecursionError
    # traceback.
    bad = problems_of("agent_config: {policies: [{id: p, action: a, when_state: '"
                      + expression + "'}]}")
    assert "agent_config.policies[0].when_state:" in bad and "nests too deeply" in bad
    assert len(bad) < 1000


@pytest.mark.parametrize(("text", "path"), [
    ("agent_config: {output_schema: {type: objekt}}", "agent_config.output_schema"),
    ("agent_config: {output_schema: {type: object, required: answer}}",
     "agent_config.output_schema"),
    ("agent_config: {output_schema: '{type: object}'}", "agent_config.output_schema"),
    ("agent_config: {think: [{id: t, instruction: i, output_schema: {minLength: -1}}]}",
     "agent_config.think[0].output_schema"),
    (f"agent_config: {{{MODEL}, agents: {{a: {{instructions: i, output_schema: "
     "{properties: []}}}}", "agent_config.agents.a.output_schema"),
])
def test_an_invalid_output_schema_is_refused(text: str, path: str) -> None:
    message = problems_of(text, OPENAI_API_KEY="k")
    assert f"{path}:" in message
    assert "not a valid JSON Schema" in message or "valid dictionary" in message


@pytest.mark.parametrize(("text", "why"), [
    ("agent_config: {model: {provider: mistral, model: m}}", "agent_config.model.provider"),
    ("agent_config: {model: {provider: openai, model: m, base_url: api.openai.com}}",
     "base_url must be an absolute http(s) URL"),
    ("agent_config: {limits: {max_iterations: 0}}", "agent_config.limits.max_iterations"),
    ("agent_config: {context: {max_history_chars: 10}}",
     "agent_config.context.max_history_chars"),
    ("agent_config: {context: {max_history_chars: lots}}",
     "agent_config.context.max_history_chars"),
    ("agent_config: {mode: hybrid}", "agent_config.mode"),
    ("agent_config: {context: {reevaluation_tools: [{id: authenticate_customer}]}}",
     "write it as namespace:tool"),
    ("agent_config: {policies: [{id: p, action: a, reevaluate_after: [crm]}]}",
     "agent_config.policies[0].reevaluate_after[0]"),
    ("agent_config: {policies: [{id: p, when: x}]}", "agent_config.policies[0].action"),
    ("agent_config: {policies: [{id: p, action: a}, {id: p, action: b}]}",
     "policies[1].id: policy id p is also policies[0].id"),
    ("agent_config: {think: [{id: t, instruction: i, output_schema: {}}], policies: [{id: p,"
     " action: a, think: {id: t, instruction: j, output_schema: {}}}]}",
     "policies[0].think.id: think step id t is also think[0].id"),
    ("agent_config: {agents: {billing: {instructions: i}}}",
     "agents.billing: no model; set agents.billing.model or agent_config.model"),
    ("agent_config: {policies: [{id: p, action: a, tools: [agent:nobody]}]}",
     "agent:nobody names no agent"),
    (f"agent_config: {{{MODEL}, agents: {{a: {{instructions: i, tools: [cars]}}}}}}",
     "tool pattern 'cars': write namespace:tool"),
    ("agent_config: {agents: {'a b': {instructions: i}}}", "agent_config.agents.a b"),
    (f"agent_config: {{{MODEL}, agents: {{default: {{instructions: i}}}}}}",
     "agent_config.agents.default: 'default' is the agent of every request that names none"),
    (f"policy: {{default_agent: kiosk}}\nagent_config: {{{MODEL}, agents: {{kiosk: "
     "{instructions: i}}}", "agent_config.agents.kiosk: 'kiosk' is the agent"),
])
def test_each_field_is_checked_where_it_is_written(text: str, why: str) -> None:
    assert why in problems_of(text, OPENAI_API_KEY="k")


def test_mcps_may_sit_in_both_places_but_an_id_only_once() -> None:
    message = problems_of("mcps: [{id: cars, hostname: 'http://h', port: 1}]\n" + SEED_MCPS,
                          CRM_MCP_KEY="k")
    assert ("agent_config.mcps[0].id: MCP server cars is also declared under mcps[0]; "
            "declare it once") in message
    m = parse_manifest("mcps: [{id: fleet, transport: stdio, command: x}]\n" + SEED_MCPS,
                       env={"CRM_MCP_KEY": "k"})
    assert [s.id for s in m.mcps] == ["fleet", "cars", "crm"]
    assert Manifest.model_validate(m).mcps == m.mcps  # merged once, not again
    assert "two MCP servers have the id crm" in problems_of(
        "agent_config: {mcps: [{id: crm, hostname: 'http://h', port: 1},"
        " {id: crm, hostname: 'http://g', port: 2}]}")
    assert "agent_config.mcps[0].pool: pool 'gpu' is not declared" in problems_of(
        "agent_config: {mcps: [{id: crm, hostname: 'http://h', port: 1, pool: gpu}]}")


def test_unknown_tool_refs_names_the_key_path_the_id_and_what_the_server_lists() -> None:
    m = parse_manifest(SEED_MCPS + """\
  context:
    reevaluation_tools:
      - id: crm:authenticate_customer
      - id: crm:get_acount_status
  policies:
    - id: auth
      action: Authenticate first.
      tools: [crm:authenticate_customer, built-in:emit_output, built-in:reason]
      reevaluate_after: [built-in:echo, tickets:create_ticket]
""", env={"CRM_MCP_KEY": "k"})
    served = {"crm": {"crm:authenticate_customer", "crm:get_account_status"},
              "cars": set(), "built-in": {"built-in:echo"}}
    assert set(PLANNER_TOOLS) == {"built-in:reason", "built-in:emit_output"}
    problems = unknown_tool_refs(m, served, complete=True)
    assert problems == [
        "agent_config.context.reevaluation_tools[1].id: crm:get_acount_status is not a tool "
        "of MCP server crm (did you mean crm:get_account_status?), which has "
        "crm:authenticate_customer, crm:get_account_status",
        "agent_config.policies[0].reevaluate_after[1]: tickets:create_ticket: no declared MCP "
        "server or tool has the namespace tickets (MCP servers: cars, crm; tool namespaces: "
        "built-in)",
    ]
    many = {"crm": {f"crm:tool_{i:02}" for i in range(25)}}
    assert unknown_tool_refs(m, many, complete=False)[0].endswith(
        "which has crm:tool_00, crm:tool_01, crm:tool_02, crm:tool_03, crm:tool_04, "
        "crm:tool_05, crm:tool_06, crm:tool_07, crm:tool_08, crm:tool_09, crm:tool_10, "
        "crm:tool_11, crm:tool_12, crm:tool_13, crm:tool_14, crm:tool_15, crm:tool_16, "
        "crm:tool_17, crm:tool_18, crm:tool_19 and 5 more")
    # A process that serves only some namespaces (`toolbus actor mcp --only crm`) checks
    # those, and leaves the others to the processes that serve them.
    assert unknown_tool_refs(m, {"crm": served["crm"]}, complete=False) == problems[:1]


def test_the_example_agent_manifest_parses() -> None:
    text = (REPO / "deploy/examples/agent.yaml").read_text()
    m = parse_manifest(text, env={"OPENAI_API_KEY": "sk-test"})
    model = m.agent_config.model
    assert model is not None and model.provider == "openai"
    assert model.base_url == "https://api.openai.com/v1" and model.api_key == "sk-test"
    assert [p.id for p in m.agent_config.policies] == ["tell_the_time"]
    assert m.agent_config.policies[0].tools == ["built-in:current_time"]
    local = parse_manifest(text, env={"OPENAI_API_KEY": "k", "OPENAI_MODEL": "smollm2",
                                      "OPENAI_BASE_URL": "http://127.0.0.1:8080/v1"})
    assert local.agent_config.model is not None
    assert local.agent_config.model.base_url == "http://127.0.0.1:8080/v1"
    assert local.agent_config.model.model == "smollm2"
    assert "${OPENAI_API_KEY} is not set" in problems_of(text)
    # Every tool it names is one it serves.
    served = {"built-in": {"built-in:echo", "built-in:current_time"}}
    assert unknown_tool_refs(m, served, complete=True) == []


def test_error_messages_never_quote_a_resolved_key() -> None:
    message = problems_of("agent_config: {model: {provider: openai, model: m, api_key: "
                          "'${K}', temperature: 9}}", K="sk-live-999")
    assert "agent_config.model.temperature" in message and "sk-live-999" not in message
    assert re.search(r"less than or equal to 2", message)


def test_the_history_budget_is_the_default_a_number_or_none() -> None:
    from actors.compressor import Compression
    from schemas.manifest import DEFAULT_MAX_HISTORY_CHARS

    def budget(text: str) -> int | None:
        return Compression.of(parse_manifest(text, env={}).agent_config).history_chars

    assert budget("") == DEFAULT_MAX_HISTORY_CHARS == 200_000
    assert budget("agent_config: {context: {max_history_chars: 30000}}") == 30_000
    assert budget("agent_config: {context: {max_history_chars: null}}") is None


def test_a_manifest_of_aliases_nested_in_each_other_is_refused_at_once() -> None:
    # Nine levels of nine aliases each: 387 million values from 400 bytes (found by a
    # new-user pass: 22 s of CPU before the errors came, nine times more per level).
    import time

    lines = ['a0: &a0 ["x"]']
    for i in range(1, 10):
        prev = f"*a{i - 1}"
        lines.append(f"a{i}: &a{i} [{', '.join([prev] * 9)}]")
    started = time.monotonic()
    message = problems_of("\n".join(lines))
    assert "expands to over 200,000 values" in message
    assert time.monotonic() - started < 2


def test_a_value_from_the_environment_is_never_quoted_in_a_manifest_error() -> None:
    text = ("agent_config:\n  mcps:\n    - {id: tickets, hostname: '${MCP_HOST}', port: 80,"
            " transport: streamable-http}\ntools:\n  http:\n"
            "    - {name: 'api:get', base_url: '${API_URL}'}\n")
    env = {"MCP_HOST": "ftp://user:s3cretpassw0rd@host", "API_URL": "notaurl s3cretTOKEN99"}
    with pytest.raises(ManifestError) as caught:
        parse_manifest(text, env=env)
    said = str(caught.value)
    # Each validator quotes what it refused: the variable's name stands in for its value.
    assert "hostname '${MCP_HOST}' must start with http://" in said, said
    assert "got '${API_URL}'" in said, said
    assert "s3cret" not in said and caught.value.__cause__ is None
