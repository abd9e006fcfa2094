"""`toolbus top`: one deployment's metrics, live in the terminal.

It reads Prometheus endpoints (the gateway's `/metrics`, or `--metrics-port` of any
process), not the bus: the lag of a consumer is consumer info, which the client role may
not read (its account reaches the streams only through the subjects it is given,
bus/auth.py), and every process already keeps its counts. Several `--url`s are merged:
counters and histograms add up, gauges of a shared consumer (lag, approvals) take the
highest, the session actors' active sessions add up.

Rates (calls/s) are over the last refresh; p50/p99 are over the calls of the last refresh
too, or since the processes started (marked `*`) when none ended in it.
"""

from __future__ import annotations

import math
import re
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from services.process import EXIT_BUS, EXIT_OK, EXIT_USAGE

__all__ = ["Scrape", "parse", "render", "top"]

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}

TOOL = "gen_ai_tool_name"
OUTCOME = "toolbus_outcome"
OUTCOMES = ("succeeded", "failed", "rejected")


class TopError(Exception):
    """What `toolbus top` cannot do, as one line; `code` is the exit status."""

    def __init__(self, message: str, code: int = EXIT_BUS) -> None:
        self.code = code
        super().__init__(message)


Labels = tuple[tuple[str, str], ...]


def parse(text: str) -> dict[str, dict[Labels, float]]:
    """Samples of a Prometheus text exposition: name -> labels -> value."""
    out: dict[str, dict[Labels, float]] = defaultdict(dict)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, raw, value = m.groups()
        labels = tuple(sorted(
            (k, re.sub(r'\\[\\"n]', lambda e: _UNESCAPE[e.group()], v))
            for k, v in _LABEL.findall(raw or "")))
        try:
            out[name][labels] = float(value)
        except ValueError:
            continue
    return out


@dataclass
class Scrape:
    """Samples merged over the endpoints, at one moment."""

    at: float
    samples: dict[str, dict[Labels, float]] = field(default_factory=dict)

    def series(self, name: str) -> dict[Labels, float]:
        return self.samples.get(name, {})


_MAX_MERGED = ("toolbus_consumer_lag", "toolbus_approvals_waiting")


def merge(texts: Iterable[str], at: float) -> Scrape:
    merged: dict[str, dict[Labels, float]] = defaultdict(lambda: defaultdict(float))
    for text in texts:
        for name, series in parse(text).items():
            for labels, value in series.items():
                target = merged[name]
                if name in _MAX_MERGED:
                    target[labels] = max(target.get(labels, 0.0), value)
                else:
                    target[labels] += value
    return Scrape(at, {k: dict(v) for k, v in merged.items()})


def _label(labels: Labels, key: str) -> str:
    return dict(labels).get(key, "")


def _calls(s: Scrape) -> dict[str, dict[str, float]]:
    """tool -> outcome -> calls."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(OUTCOMES, 0.0))
    for labels, value in s.series("toolbus_calls_total").items():
        out[_label(labels, TOOL)][_label(labels, OUTCOME)] = value
    return out


def _buckets(s: Scrape) -> dict[str, list[tuple[float, float]]]:
    """tool -> [(upper bound, cumulative count)] of the call duration histogram."""
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for labels, value in s.series("toolbus_call_duration_seconds_bucket").items():
        le = _label(labels, "le")
        out[_label(labels, TOOL)].append((math.inf if le == "+Inf" else float(le), value))
    for buckets in out.values():
        buckets.sort()
    return out


def quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """As Prometheus's histogram_quantile: linear within the bucket that holds rank q."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower  # in the open bucket: its lower bound is all that is known
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def _delta(now: list[tuple[float, float]], then: list[tuple[float, float]]
           ) -> list[tuple[float, float]]:
    before = dict(then)
    return [(bound, count - before.get(bound, 0.0)) for bound, count in now]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.3g}"


def render(now: Scrape, then: Scrape | None) -> list[str]:
    """The snapshot as lines of text."""
    dt = (now.at - then.at) if then is not None else 0.0
    calls, before = _calls(now), _calls(then) if then is not None else {}
    buckets, old_buckets = _buckets(now), _buckets(then) if then is not None else {}

    def rate(value: float, old: float) -> str:
        return f"{(value - old) / dt:.1f}" if dt > 0 else "-"

    sessions = sum(now.series("toolbus_sessions_active").values())
    approvals = max(now.series("toolbus_approvals_waiting").values(), default=0.0)
    total = {o: sum(c[o] for c in calls.values()) for o in OUTCOMES}
    total_before = sum(sum(c.values()) for c in before.values())
    lines = [
        f"sessions active   {sessions:g}",
        f"approvals waiting {approvals:g}",
        f"calls/s           {rate(sum(total.values()), total_before)}   (ended: "
        + ", ".join(f"{total[o]:g} {o}" for o in OUTCOMES) + ")",
        "",
        f"{'tool':<32} {'calls/s':>8} {'succeeded':>10} {'failed':>8} {'rejected':>9} "
        f"{'p50 ms':>8} {'p99 ms':>8}",
    ]
    for tool in sorted(calls):
        c = calls[tool]
        old = sum(before.get(tool, {}).values())
        window = _delta(buckets.get(tool, []), old_buckets.get(tool, []))
        mark = ""
        if not window or window[-1][1] <= 0:
            window, mark = buckets.get(tool, []), "*"
        p50, p99 = quantile(0.5, window), quantile(0.99, window)
        lines.append(
            f"{tool:<32} {rate(sum(c.values()), old):>8} {c['succeeded']:>10g} "
            f"{c['failed']:>8g} {c['rejected']:>9g} "
            f"{_ms(p50) + (mark if p50 is not None else ''):>8} "
            f"{_ms(p99) + (mark if p99 is not None else ''):>8}")
    if not calls:
        lines.append("(no calls ended yet)")
    lines += ["", f"{'pool':<16} {'consumer':<40} {'lag':>8}"]
    lag = sorted(((_label(labels, "toolbus_pool") or "-",
                   _label(labels, "messaging_consumer_group_name"), value)
                  for labels, value in now.series("toolbus_consumer_lag").items()),
                 key=lambda row: (row[0] == "-", row[0], row[1]))
    for pool, consumer, value in lag:
        lines.append(f"{pool:<16} {consumer:<40} {value:>8g}")
    if not lag:
        lines.append("(no consumer lag reported)")
    return lines


def _scrape(client: httpx.Client, urls: Sequence[str], token: str | None) -> Scrape:
    texts = []
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    for url in urls:
        try:
            answer = client.get(url, headers=headers)
        except httpx.HTTPError as exc:
            reason = str(exc) or type(exc).__name__
            raise TopError(f"cannot read {url}: {reason}; is `toolbus up --http-port` (or "
                           "--metrics-port) running there?") from exc
        if answer.status_code in (401, 403):
            raise TopError(f"{url} refused the token ({answer.status_code}): pass "
                           "--token-file with a role's token (<data-dir>/auth/client.token)",
                           EXIT_USAGE)
        if answer.status_code != 200:
            raise TopError(f"{url} answered {answer.status_code}: "
                           f"{answer.text.strip()[:200]}")
        # Empty is a metrics page with nothing counted yet (a process just started).
        if answer.text.strip() and "# TYPE " not in answer.text and not parse(answer.text):
            raise TopError(f"{url} is not a metrics page (no Prometheus `# TYPE` line, no "
                           "sample): point --url at /metrics of `toolbus up --http-port` "
                           "(or at its --metrics-port)", EXIT_USAGE)
        texts.append(answer.text)
    return merge(texts, time.monotonic())


def read_token(path: Path | None, data_dir: Path) -> str | None:
    """The bearer token: `--token-file`, else the client's in the data dir, if any."""
    if path is not None:
        try:
            return path.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise TopError(f"cannot read --token-file {path}: {exc.strerror or exc}",
                           EXIT_USAGE) from exc
        except UnicodeDecodeError:
            raise TopError(f"--token-file {path} is not a token (not UTF-8 text): give "
                           "<data-dir>/auth/<role>.token", EXIT_USAGE) from None
    default = data_dir / "auth" / "client.token"
    try:
        return default.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None


def top(urls: Sequence[str], *, token: str | None, interval_s: float, once: bool) -> int:
    """Print snapshots every `interval_s` until interrupted, or one (`once`, its rates over
    one interval). Returns the exit status; a failure is one line on stderr."""
    for url in urls:
        if not url.startswith(("http://", "https://")):
            print(f"toolbus top: --url {url} is not an http(s) URL (for example "
                  "http://127.0.0.1:8787/metrics)", file=sys.stderr)
            return EXIT_USAGE
    # A URL without a path is the server's: its metrics are at /metrics.
    urls = [urlsplit(u)._replace(path="/metrics").geturl()
            if not urlsplit(u).path.strip("/") else u for u in urls]
    live = not once and sys.stdout.isatty()
    try:
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            then = _scrape(client, urls, token)
            while True:
                time.sleep(interval_s)
                now = _scrape(client, urls, token)
                lines = render(now, then)
                head = f"toolbus top  {' '.join(urls)}  (every {interval_s:g} s)"
                if live:
                    sys.stdout.write("\x1b[H\x1b[2J")
                sys.stdout.write("\n".join([head, *lines]) + "\n")
                sys.stdout.flush()
                if once:
                    return EXIT_OK
                then = now
    except TopError as exc:
        print(f"toolbus top: {exc}", file=sys.stderr)
        return exc.code
