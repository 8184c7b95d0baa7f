"""What a campaign writes from its summary (``fuzz/summary.py``): the text, the JSON and the JUnit report."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from .engine_coverage import SHOWN_RANGES, ModuleCoverage
from .messages import bounded, cut, one_line
from .stats import CampaignStats, shown
from .summary import CampaignSummary, FailureSummary


def print_summary(summary: CampaignSummary, p: Callable[..., None], quiet: bool = False) -> None:
    """The summary: time and volume per machine, the reach, the counts (short with ``quiet``), every failure, and
    last, why the campaign broke when it did."""
    s = summary.stats
    p("")
    p("== summary ==")
    p(
        f"time {summary.elapsed_s:.1f} s   batches {summary.batches}   examples {s.examples}"
        f"   steps {s.steps} ({summary.steps_per_s:.0f} steps/s)"
        + (f", rule calls {s.calls} ({summary.calls_per_s:.0f}/s)" if s.calls != s.steps else "")
        + f"   on {summary.backend}"
    )
    p("examples per machine: " + ", ".join(f"{m.name} {m.examples_run}" for m in summary.machines))
    p(
        f"reach: largest tree {shown(s.largest_tree_pages, ' pages')},"
        f" longest key {shown(s.longest_key_tokens, ' tokens')},"
        f" deepest path {shown(s.deepest_path_nodes, ' nodes')},"
        f" most evictable leaves {shown(s.most_evictable_leaves)},"
        f" largest eviction {shown(s.largest_evict_pages, ' pages')}, most namespaces {shown(s.most_namespaces)},"
        f" largest KV store {shown(s.largest_store_rows, ' rows')}, most workers {shown(s.most_workers)},"
        f" most pages indexed by a router {shown(s.most_router_blocks)}  (n/a: not observable by these machines)"
    )
    p(f"evicted pages {s.evicted_pages}   KV events replayed {s.events_replayed}")
    if s.prompt_tokens:
        p(
            f"requests: token hit rate {100.0 * s.hit_tokens / s.prompt_tokens:.1f} % ({s.hit_tokens} of"
            f" {s.prompt_tokens} prompt tokens cached when matched)"
            + (
                f", of the workload mix {100.0 * s.workload_hit_tokens / s.workload_tokens:.1f} %"
                f" ({s.workload_hit_tokens} of {s.workload_tokens})"
                if s.workload_tokens
                else ""
            )
            + f", most running at once {shown(s.most_running_requests)}"
        )
    if s.most_transfers_in_flight is not None:
        ended = {rule: n for rule, n in s.rules.items() if rule.startswith("tiered.") and "[" in rule}
        p(
            f"tiers: largest host tier {shown(s.largest_host_pages, ' pages')},"
            f" largest storage {shown(s.largest_storage_pages, ' pages')},"
            f" most transfers in flight {shown(s.most_transfers_in_flight)};"
            + "".join(f" {rule[len('tiered.') :]} {n}," for rule, n in sorted(ended.items())).rstrip(",")
        )
    if s.router_scores_checked:
        p(f"router: scores checked {s.router_scores_checked}   removals relayed {s.router_removals}")
    if s.router_faults:
        faults = ", ".join(
            f"{kind} {n} ({s.router_recovered[kind]} recovered)" for kind, n in sorted(s.router_faults.items())
        )
        p(
            f"router faults: {faults}; while one lasted, the largest over-estimate"
            f" {shown(s.most_router_over_pages, ' pages')},"
            f" under-estimate {shown(s.most_router_under_pages, ' pages')},"
            f" longest {shown(s.longest_router_outage_steps, ' steps')}"
        )
    if summary.coverage is not None:
        print_coverage(p, summary.coverage, quiet)
    swarms = {
        rule[len("swarm[") : -len("] batches")]: n
        for rule, n in s.rules.items()
        if rule.startswith("swarm[") and rule.endswith("] batches")
    }
    if swarms:
        p(
            "swarm batches: "
            + ", ".join(f"{machine} {n}" for machine, n in swarms.items())
            + " (each rule off with probability one half; which, counted per rule without --quiet and in --json)"
        )
    fresh = " (fresh)" if summary.seed_was_fresh else ""
    p(f"seed {summary.seed}{fresh}: radixspec fuzz --seed {summary.seed} with the same options reruns it")
    if quiet:
        p(
            f"rules hit: {len(s.rules)} distinct, {sum(s.rejected.values())} rejected calls,"
            f" {sum(s.skipped.values())} invalid calls not sent (listed without --quiet, and in --json)"
        )
    else:
        print_counts(p, s)
    failures = summary.failures
    if not failures:
        p("failures: none found in what ran" if summary.broken else "failures: none")
    else:
        p(f"failures: {len(failures)}")
    for machine in summary.machines:
        for failure in machine.failures:
            print_failure(p, failure)
            if machine.extra_failures:
                p(f"({machine.extra_failures} more batches of this machine failed too)")
            p("shrunk program:" if failure.shrunk else "failing program (not shrunk):")
            for statement in failure.program:
                for line in one_line(statement).splitlines():
                    p(f"    {cut(line)}")
    print_broken(p, summary)


def print_coverage(p: Callable[..., None], modules: tuple[ModuleCoverage, ...], quiet: bool) -> None:
    """The engine modules' lines and branches reached (--coverage), each module's never-reached lines listed
    (every one in the JSON); with ``quiet``, the percentages only."""
    statements = sum(module.statements for module in modules)
    covered = sum(module.covered for module in modules)
    share = f"{100.0 * covered / statements:.1f} %" if statements else "n/a"
    reachable = sum(module.reachable for module in modules)
    on_cpu = f"{100.0 * covered / reachable:.1f} %" if reachable else "n/a"
    p(
        f"engine coverage: lines {share} ({covered}/{statements}) of {len(modules)} modules; of the lines reachable on"
        f" a CPU {on_cpu} ({covered}/{reachable})"
    )
    for module in modules:
        p(f"  {module.describe(ranges=0 if quiet else SHOWN_RANGES)}")


def print_broken(p: Callable[..., None], summary: CampaignSummary) -> None:
    """The last lines of a campaign that broke (exit 3): what could not run, and why."""
    if not summary.broken:
        return
    p("")
    count = len(summary.broken)
    p(f"CAMPAIGN BROKEN (exit 3): {count} problem{'s' * (count > 1)}; what did not run was not checked")
    for machine, reason in summary.broken:
        first = reason.splitlines()[0] if reason else ""
        p(f"  {machine or 'campaign'}: {cut(first)}")


def print_failure(p: Callable[..., None], failure: FailureSummary) -> None:
    """A failure's heading, its bounded message and its regression file."""
    p("")
    p(
        f"--- {failure.machine}: first failing example after {failure.found_after_s:.1f} s,"
        f" {'' if failure.shrunk else 'not '}shrunk and reported after {failure.reported_after_s:.1f} s"
        f" (batch seed {failure.seed})"
    )
    for line in bounded(failure.error):
        p(line)
    path = failure.regression_test
    if path is not None:
        p(f"regression test: {path}  (python -m pytest {path}; it holds the whole message)")
    else:
        p(f"regression test: none written (the program did not replay as Python); batch seed {failure.seed}")


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


def write_json(summary: CampaignSummary, path: Path) -> None:
    """The summary as JSON (--json)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary.as_dict(), indent=2))


def write_junit(summary: CampaignSummary, path: Path) -> None:
    """A JUnit XML report (--junit-xml): one test suite, one test case per machine (its batches' time), a
    failure element per distinct failure with its regression file and the program that reproduces it."""
    from xml.etree import ElementTree as ET

    elapsed = f"{summary.elapsed_s:.3f}"
    suite = ET.Element(
        "testsuite",
        name="radixspec fuzz",
        tests=str(len(summary.machines) + bool(summary.problems)),
        failures=str(len(summary.failures)),
        errors=str(len(summary.broken)),
        skipped="0",
        time=elapsed,
        timestamp=time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(summary.started_at)),
    )
    properties = ET.SubElement(suite, "properties")
    shown_versions = {k: v for k, v in summary.versions.items() if k != "targets"}
    for key, value in [("seed", summary.seed), ("targets", ",".join(summary.targets)), *shown_versions.items()]:
        ET.SubElement(properties, "property", name=str(key), value=str(value))
    driven = ",".join(summary.targets)
    for machine in summary.machines:
        # the machines run side by side for the whole campaign: each case's time is the campaign's
        case = ET.SubElement(
            suite,
            "testcase",
            classname=f"radixspec.fuzz.{machine.name}",
            name=f"{machine.name}[{driven}]",
            time=elapsed,
        )
        ET.SubElement(case, "system-out").text = f"batches {machine.batches}, examples {machine.examples_run}"
        if machine.broken is not None:
            ET.SubElement(
                case, "error", message=one_line(machine.broken)[:500], type="radixspec.broken"
            ).text = machine.broken
        for failure in machine.failures:
            element = ET.SubElement(case, "failure", message=one_line(failure.error)[:500], type="radixspec.failure")
            test_file = failure.regression_test
            lines = [failure.error, "", f"batch seed {failure.seed}; campaign seed {summary.seed}"]
            lines += [f"regression test: {test_file}" if test_file else "regression test: not written"]
            lines += ["", *failure.program]
            element.text = "\n".join(lines)
    if summary.problems:
        # the campaign's own breakage belongs to no machine: a case of its own
        case = ET.SubElement(suite, "testcase", classname="radixspec.fuzz", name="campaign", time=elapsed)
        text = "\n".join(summary.problems)
        ET.SubElement(case, "error", message=one_line(text)[:500], type="radixspec.broken").text = text
    path.parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(suite).write(path, encoding="utf-8", xml_declaration=True)
