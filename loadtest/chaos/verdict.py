"""A chaos run's verdict: the report, what failed, and its printed summary."""

from __future__ import annotations

from dataclasses import asdict

from loadtest.chaos.config import ChaosConfig
from loadtest.chaos.scenarios import Tally


def verdict(config: ChaosConfig, tally: Tally, idle: dict, rss: list[int], elapsed_s: float) -> dict:
    stats = idle["stats"]
    report = {
        "config": asdict(config) | {"api_key": "set" if config.api_key else None},
        "elapsed_s": round(elapsed_s, 1),
        "requests": tally.requests_by_kind(),
        "num_requests": len(tally.outcomes),
        "statuses": tally.statuses_by_kind(),
        "valid_5xx": tally.num_valid_5xx(),
        "problems": tally.problems(),
        "kv_blocks": {"total": stats["num_kv_blocks_total"], "free_at_idle": stats["num_kv_blocks_total"]
                      - stats["num_kv_blocks_used"], "leaked": stats["num_kv_blocks_used"]},
        "stuck": {"num_active_requests": idle["num_active_requests"], "num_running": stats["num_running"],
                  "num_waiting": stats["num_waiting"]},
        "engine_rss_mb": {"after_warmup": mb(rss[0]), "half_way": mb(rss[1]), "end": mb(rss[2]),
                          "growth_first_half": mb(rss[1] - rss[0]), "growth_second_half": mb(rss[2] - rss[1])},
    }
    report["failures"] = failures(config, report)
    report["passed"] = not report["failures"]
    return report


def failures(config: ChaosConfig, report: dict) -> list[str]:
    found = []
    if report["valid_5xx"]:
        found.append(f"{report['valid_5xx']} valid requests got a 5xx")
    if report["problems"]:
        found.append(f"{len(report['problems'])} requests misbehaved (see problems)")
    if report["kv_blocks"]["leaked"]:
        found.append(f"{report['kv_blocks']['leaked']} KV blocks still in use at idle")
    if any(report["stuck"].values()):
        found.append(f"requests stuck in the engine: {report['stuck']}")
    growth = report["engine_rss_mb"]["growth_second_half"]
    if growth > config.max_rss_growth_mb:
        found.append(f"engine RSS grew {growth} MB in the second half (limit {config.max_rss_growth_mb})")
    return found


def mb(num_bytes: int) -> float:
    return round(num_bytes / 2**20, 1)


def summary(report: dict) -> str:
    lines = [f"chaos run: {report['num_requests']} requests in {report['elapsed_s']} s "
             f"-> {'PASSED' if report['passed'] else 'FAILED'}"]
    for kind, statuses in report["statuses"].items():
        lines.append(f"  {kind:<16} {sum(statuses.values()):>6}  " + ", ".join(f"{s}: {n}" for s, n in statuses.items()))
    kv, rss = report["kv_blocks"], report["engine_rss_mb"]
    lines += [f"  valid requests with a 5xx: {report['valid_5xx']}",
              f"  KV blocks: {kv['free_at_idle']}/{kv['total']} free at idle, {kv['leaked']} leaked",
              f"  stuck in the engine: {report['stuck']}",
              f"  engine RSS at idle: {rss['after_warmup']} MB after warm-up, {rss['half_way']} MB half-way "
              f"({rss['growth_first_half']:+}), {rss['end']} MB at the end ({rss['growth_second_half']:+})"]
    lines += [f"  FAIL: {f}" for f in report["failures"]] + [f"    {p}" for p in report["problems"][:10]]
    return "\n".join(lines)
