"""What a campaign prints and writes: the progress line, the summary, the JSON summary."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .messages import bounded, cut, one_line
from .stats import REACH, CampaignStats, shown

if TYPE_CHECKING:
    from .campaign import Campaign


def print_summary(campaign: Campaign, elapsed: float) -> None:
    """The summary: time and volume, the reach, the counts (short with --quiet), every failure."""
    p, s = campaign.print, campaign.stats
    p("")
    p("== summary ==")
    p(
        f"time {elapsed:.1f} s   batches {sum(m.batches for m in campaign.machines.values())}   examples {s.examples}"
        f"   steps {s.steps} ({s.steps / max(elapsed, 1e-9):.0f} steps/s)   on {campaign.backend_name}"
    )
    p(
        f"reach: largest tree {shown(s.largest_tree_pages, ' pages')},"
        f" longest key {shown(s.longest_key_tokens, ' tokens')},"
        f" deepest path {shown(s.deepest_path_nodes, ' nodes')},"
        f" most evictable leaves {shown(s.most_evictable_leaves)},"
        f" largest eviction {shown(s.largest_evict_pages, ' pages')}, most namespaces {shown(s.most_namespaces)},"
        f" largest KV store {shown(s.largest_store_rows, ' rows')}  (n/a: not observable by these machines)"
    )
    p(f"evicted pages {s.evicted_pages}   KV events replayed {s.events_replayed}")
    fresh = " (fresh)" if getattr(campaign.args, "fresh_seed", False) else ""
    p(f"seed {campaign.args.seed}{fresh}: radixspec fuzz --seed {campaign.args.seed} with the same options reruns it")
    if campaign.args.quiet:
        p(
            f"rules hit: {len(s.rules)} distinct, {sum(s.rejected.values())} rejected calls,"
            f" {sum(s.skipped.values())} invalid calls not sent (listed without --quiet, and in --json)"
        )
    else:
        print_counts(p, s)
    failed = [(state, failure, path) for state in campaign.machines.values() for failure, path in state.failures]
    if not failed:
        p("failures: none")
        return
    p(f"failures: {len(failed)}")
    for state, failure, path in failed:
        p("")
        p(
            f"--- {state.name}: first failing example after {failure.found_at - campaign.start:.1f} s,"
            f" {'' if failure.shrunk else 'not '}shrunk and reported after {failure.reported_at - campaign.start:.1f} s"
            f" (batch seed {failure.seed})"
        )
        for line in bounded(failure.error):
            p(line)
        if path is not None:
            p(f"regression test: {path}  (python -m pytest {path}; it holds the whole message)")
        else:
            p(f"regression test: none written (the program did not replay as Python); batch seed {failure.seed}")
        if state.extra_failures:
            p(f"({state.extra_failures} more batches of this machine failed too)")
        p("shrunk program:" if failure.shrunk else "failing program (not shrunk):")
        for statement in failure.program:
            for line in one_line(statement).splitlines():
                p(f"    {cut(line)}")


def print_counts(p: Callable[..., None], s: CampaignStats) -> None:
    """Every rule's steps, every rejection and every call not sent, by name."""
    p("rules hit:")
    for rule_name, count in sorted(s.rules.items()):
        p(f"  {rule_name:<52} {count:>9}")
    if s.rejected:
        p("rejected calls (same error class from every implementation, state unchanged):")
        for error, count in sorted(s.rejected.items()):
            p(f"  {error:<52} {count:>9}")
    if s.skipped:
        p("invalid calls not sent (the target does not validate; the spec rejects them):")
        for label, count in sorted(s.skipped.items()):
            p(f"  {label:<52} {count:>9}")


# the JSON summary's layout; docs/campaigns.md describes each field. A new field keeps the version; a renamed,
# removed or retyped one bumps it
SCHEMA_VERSION = 1


def versions(campaign: Campaign) -> dict[str, Any]:
    """radixspec, Python, Hypothesis and torch (None: not installed; torch's version read without importing it),
    and the engine package of every target (its installed version; ours: radixspec's)."""
    from importlib import metadata

    from .commands import versions as our_versions
    from .targets import resolve

    found: dict[str, Any] = dict(our_versions())
    engines: dict[str, dict[str, str | None]] = {}
    for name in campaign.targets:
        try:
            requires = resolve(name, check=False).requires
        except Exception:  # the campaign ran it, so it resolves; a listing never fails the summary
            requires = ()
        packages: dict[str, str | None] = {}
        for package, _ in requires:
            try:
                packages[package] = metadata.version(package)
            except metadata.PackageNotFoundError:
                packages[package] = None
        engines[name] = packages or {"radixspec": found["radixspec"]}
    found["targets"] = engines
    return found


def summary_dict(campaign: Campaign, elapsed: float) -> dict[str, Any]:
    """The summary as a JSON-ready dict (--json), the counts listed in full."""
    s = campaign.stats
    return {
        "schema_version": SCHEMA_VERSION,
        "versions": versions(campaign),
        "elapsed_s": round(elapsed, 3),
        "budget_s": campaign.budget_s,
        "seed": campaign.args.seed,
        "seed_was_fresh": bool(getattr(campaign.args, "fresh_seed", False)),
        "machines": list(campaign.machines),
        "targets": list(campaign.targets),
        "lru": campaign.args.lru,
        "backend": campaign.backend_name,
        "batches": sum(m.batches for m in campaign.machines.values()),
        "examples": s.examples,
        "steps": s.steps,
        "steps_per_s": round(s.steps / max(elapsed, 1e-9), 1),
        **{name: getattr(s, name) for name in REACH},
        "evicted_pages": s.evicted_pages,
        "events_replayed": s.events_replayed,
        "rules": dict(s.rules),
        "rejected": dict(s.rejected),
        "skipped": dict(s.skipped),
        "failures": [
            {
                "machine": state.name,
                "error": failure.error,
                "found_after_s": round(failure.found_at - campaign.start, 3),
                "reported_after_s": round(failure.reported_at - campaign.start, 3),
                "seed": failure.seed,
                "shrunk": failure.shrunk,
                "regression_test": str(path) if path else None,
            }
            for state in campaign.machines.values()
            for failure, path in state.failures
        ],
    }


def write_json(campaign: Campaign, elapsed: float) -> None:
    """The summary as JSON (--json)."""
    campaign.args.json.parent.mkdir(parents=True, exist_ok=True)
    campaign.args.json.write_text(json.dumps(summary_dict(campaign, elapsed), indent=2))


def write_junit(campaign: Campaign, elapsed: float) -> None:
    """A JUnit XML report (--junit-xml): one test suite, one test case per machine (its batches' time), a
    failure element per distinct failure with its regression file and the program that reproduces it."""
    from xml.etree import ElementTree as ET

    summary = summary_dict(campaign, elapsed)
    failed = sum(len(state.failures) for state in campaign.machines.values())
    suite = ET.Element(
        "testsuite",
        name="radixspec fuzz",
        tests=str(len(campaign.machines)),
        failures=str(failed),
        errors="0",
        skipped="0",
        time=f"{elapsed:.3f}",
        timestamp=time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(campaign.start)),
    )
    properties = ET.SubElement(suite, "properties")
    shown_versions = {k: v for k, v in summary["versions"].items() if k != "targets"}
    for key, value in [("seed", summary["seed"]), ("targets", ",".join(summary["targets"])), *shown_versions.items()]:
        ET.SubElement(properties, "property", name=str(key), value=str(value))
    driven = ",".join(campaign.targets)
    for state in campaign.machines.values():
        # the machines run side by side for the whole campaign: each case's time is the campaign's
        case = ET.SubElement(
            suite,
            "testcase",
            classname=f"radixspec.fuzz.{state.name}",
            name=f"{state.name}[{driven}]",
            time=f"{elapsed:.3f}",
        )
        ET.SubElement(case, "system-out").text = f"batches {state.batches}, examples {state.examples}"
        for failure, path in state.failures:
            element = ET.SubElement(case, "failure", message=one_line(failure.error)[:500], type="radixspec.failure")
            lines = [failure.error, "", f"batch seed {failure.seed}; campaign seed {summary['seed']}"]
            lines += [f"regression test: {path}" if path else "regression test: not written", "", *failure.program]
            element.text = "\n".join(lines)
    campaign.args.junit_xml.parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(suite).write(campaign.args.junit_xml, encoding="utf-8", xml_declaration=True)


class Progress:
    """A progress line: rewritten in place on a terminal, every 10 s otherwise."""

    def __init__(self, campaign: Campaign) -> None:
        self.campaign = campaign
        self.tty = campaign.out.isatty()
        self.last = 0.0

    def update(self) -> None:
        campaign = self.campaign
        elapsed = time.time() - campaign.start
        if campaign.args.quiet or (not self.tty and elapsed - self.last < 10):
            return
        self.last = elapsed
        budget = campaign.budget_s
        of = f"/{budget:.0f}" if budget else ""
        s = campaign.stats
        shrinking = [
            name for name, state in campaign.machines.items() if name in campaign.notified and state.failure is None
        ]
        reach = [
            f"{what} {value}{unit}"
            for what, value, unit in (
                ("largest tree", s.largest_tree_pages, " pages"),
                ("longest key", s.longest_key_tokens, ""),
                ("largest KV store", s.largest_store_rows, " rows"),
            )
            if value is not None
        ]
        line = "  ".join(
            [
                f"[{elapsed:5.0f}{of} s] examples {s.examples}",
                f"steps {s.steps}",
                *reach,
                f"failures {sum(1 for m in campaign.machines.values() if m.failure)}",
                *([f"shrinking: {', '.join(shrinking)}"] if shrinking else []),
            ]
        )
        print(f"\r{line}" if self.tty else line, end="" if self.tty else "\n", file=campaign.out, flush=True)

    def done(self) -> None:
        if self.tty and not self.campaign.args.quiet:
            print(file=self.campaign.out)
