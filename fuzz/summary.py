"""A campaign's outcome as one object: ``Campaign.summary()`` makes it; the text, JSON and JUnit writers
(``fuzz/report.py``) read only it. Each figure is named here once; ``as_dict`` is the JSON layout that
docs/campaigns.md describes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

from .engine_coverage import ModuleCoverage
from .stats import REACH, CampaignStats

# the JSON summary's layout; docs/campaigns.md describes each field. A new, renamed, removed or retyped field
# bumps it (2: ``broken`` and ``machine_examples``; 3: ``coverage``, ``prompt_tokens``, ``hit_tokens`` and
# ``most_running_requests``; 4: ``workload_tokens`` and ``workload_hit_tokens``; 5: in ``coverage``, the lines
# reachable on a CPU; 6: ``calls`` and ``calls_per_s``)
SCHEMA_VERSION = 6
# a package's version, None when it is not installed
Version: TypeAlias = str | None
# each target's engine packages and their versions
EngineVersions: TypeAlias = dict[str, dict[str, Version]]


@dataclass(frozen=True)
class FailureSummary:
    """One distinct failure of a machine."""

    machine: str
    error: str
    # the batch's seed (the campaign's seed, the machine and the batch number make it)
    seed: int
    found_after_s: float
    reported_after_s: float
    shrunk: bool
    # the runnable pytest file, None when the program did not replay as Python
    regression_test: Path | None
    # the (shrunk) program's statements
    program: tuple[str, ...]


@dataclass(frozen=True)
class MachineSummary:
    """How far one machine got."""

    name: str
    batches: int
    examples: int
    failures: tuple[FailureSummary, ...]
    # failing batches whose failure repeated one already recorded
    extra_failures: int
    # examples that ran (``examples``: those handed to its batches)
    examples_run: int = 0
    # why it could not run (a batch could not start it, or it ran no example); None when it ran
    broken: str | None = None


@dataclass(frozen=True)
class CampaignSummary:
    """What a campaign ran and found."""

    elapsed_s: float
    # None: the campaign ran a number of examples, not a time budget
    budget_s: float | None
    seed: int
    seed_was_fresh: bool
    machines: tuple[MachineSummary, ...]
    targets: tuple[str, ...]
    lru: str | None
    backend: str
    stats: CampaignStats
    # time.time() at the start
    started_at: float
    # radixspec, Python, Hypothesis, torch, and each target's engine packages (``versions``)
    versions: dict[str, Version | EngineVersions]
    # why the campaign as a whole broke (its backend failed, it was interrupted)
    problems: tuple[str, ...] = ()
    # --coverage: what the batches reached of each engine module; None without it
    coverage: tuple[ModuleCoverage, ...] | None = None

    @property
    def broken(self) -> list[tuple[str | None, str]]:
        """Why the campaign itself broke (exit 3), as (machine, reason); machine None: the whole campaign."""
        found: list[tuple[str | None, str]] = [(None, problem) for problem in self.problems]
        return found + [(machine.name, machine.broken) for machine in self.machines if machine.broken is not None]

    @property
    def batches(self) -> int:
        return sum(machine.batches for machine in self.machines)

    @property
    def failures(self) -> list[FailureSummary]:
        return [failure for machine in self.machines for failure in machine.failures]

    @property
    def steps_per_s(self) -> float:
        return self.stats.steps / max(self.elapsed_s, 1e-9)

    @property
    def calls_per_s(self) -> float:
        return self.stats.calls / max(self.elapsed_s, 1e-9)

    def as_dict(self) -> dict[str, object]:
        """The summary as a JSON-ready dict (--json), the counts listed in full."""
        s = self.stats
        return {
            "schema_version": SCHEMA_VERSION,
            "versions": self.versions,
            "elapsed_s": round(self.elapsed_s, 3),
            "budget_s": self.budget_s,
            "seed": self.seed,
            "seed_was_fresh": self.seed_was_fresh,
            "machines": [machine.name for machine in self.machines],
            "machine_examples": {machine.name: machine.examples_run for machine in self.machines},
            "broken": [{"machine": machine, "reason": reason} for machine, reason in self.broken],
            "targets": list(self.targets),
            "lru": self.lru,
            "backend": self.backend,
            "batches": self.batches,
            "examples": s.examples,
            "steps": s.steps,
            "steps_per_s": round(self.steps_per_s, 1),
            "calls": s.calls,
            "calls_per_s": round(self.calls_per_s, 1),
            **{name: getattr(s, name) for name in REACH},
            "evicted_pages": s.evicted_pages,
            "prompt_tokens": s.prompt_tokens,
            "hit_tokens": s.hit_tokens,
            "workload_tokens": s.workload_tokens,
            "workload_hit_tokens": s.workload_hit_tokens,
            "events_replayed": s.events_replayed,
            "router_scores_checked": s.router_scores_checked,
            "router_removals": s.router_removals,
            "router_faults": dict(s.router_faults),
            "router_recovered": dict(s.router_recovered),
            "rules": dict(s.rules),
            "rejected": dict(s.rejected),
            "skipped": dict(s.skipped),
            "coverage": None if self.coverage is None else [module.as_dict() for module in self.coverage],
            "failures": [
                {
                    "machine": failure.machine,
                    "error": failure.error,
                    "found_after_s": round(failure.found_after_s, 3),
                    "reported_after_s": round(failure.reported_after_s, 3),
                    "seed": failure.seed,
                    "shrunk": failure.shrunk,
                    "regression_test": str(failure.regression_test) if failure.regression_test else None,
                }
                for failure in self.failures
            ],
        }


def versions(targets: tuple[str, ...]) -> dict[str, Version | EngineVersions]:
    """radixspec, Python, Hypothesis and torch (None: not installed; torch's version read without importing it),
    and the engine package of every target (its installed version; ours: radixspec's)."""
    from importlib import metadata

    from .commands import versions as our_versions
    from .targets import resolve

    ours = our_versions()
    engines: EngineVersions = {}
    for name in targets:
        try:
            requires = resolve(name, check=False).requires
        except Exception:  # the campaign ran it, so it resolves; a listing never fails the summary
            requires = ()
        packages: dict[str, Version] = {}
        for package, _ in requires:
            try:
                packages[package] = metadata.version(package)
            except metadata.PackageNotFoundError:
                packages[package] = None
        engines[name] = packages or {"radixspec": ours["radixspec"]}
    return {**ours, "targets": engines}
