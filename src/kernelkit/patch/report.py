"""What `kernelkit.patch` replaced, what it left alone and why, and how often a call fell back."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Replacement:
    kind: str  # "rms_norm", "mlp", "moe", "rope", "attention", "cross_entropy"
    target: str  # the Hugging Face class whose instances (or whose forward) now run kernelkit
    op: str  # what runs instead
    count: int


@dataclass
class PatchReport:
    """Returned by `kernelkit.patch`. `fallbacks` counts, per (kind, reason), the calls that ran the
    original code because kernelkit cannot compute them exactly (updated at call time; a fallback traced
    under torch.compile is recorded with count 0, not counted per call)."""

    model: str
    family: str
    replaced: list[Replacement] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (what, why), each pair once
    skipped_count: dict[tuple[str, str], int] = field(default_factory=dict)  # how many instances per pair
    fallbacks: dict[tuple[str, str], int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # where the patched model computes differently, and why
    # (kind, shape, original) -> the choice.Choice made there: which path runs, measured how
    choices: dict = field(default_factory=dict)

    def add(self, kind: str, target: str, op: str, count: int) -> None:
        if count:
            self.replaced.append(Replacement(kind, target, op, count))

    def skip(self, what: str, why: str) -> None:
        key = (what, why)
        if key not in self.skipped_count:
            self.skipped.append(key)
        self.skipped_count[key] = self.skipped_count.get(key, 0) + 1

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def fell_back(self, kind: str, reason: str) -> None:
        key = (kind, reason)
        if torch.compiler.is_compiling():
            # A count that changes on every call is a value torch.compile guards on: each call would fail
            # the guard and recompile (the patched, compiled prefill took 765 ms a call on the H100). Under
            # compile the reason is recorded once, with count 0, shown as "under torch.compile".
            if key not in self.fallbacks:
                self.fallbacks[key] = 0
            return
        self.fallbacks[key] = self.fallbacks.get(key, 0) + 1

    def chose(self, choice) -> None:
        """Record which path runs at one shape (`choose.Choice`); the latest decision per shape wins."""
        self.choices[(choice.kind, choice.shape, choice.original)] = choice

    def running(self, kind: str | None = None) -> list:
        """The choices made so far (of `kind`), each with `.path` ("kernelkit" or the model's own)."""
        return [c for (k, _, _), c in self.choices.items() if kind is None or k == kind]

    def count(self, kind: str) -> int:
        """How many modules (or forwards) of `kind` were replaced."""
        return sum(r.count for r in self.replaced if r.kind == kind)

    def fallback_count(self, kind: str | None = None) -> int:
        return sum(n for (k, _), n in self.fallbacks.items() if kind is None or k == kind)

    def table(self):
        """A rich Table: one row per replacement, then what was left alone and the fallbacks so far."""
        from rich.table import Table

        t = Table(title=f"kernelkit.patch: {self.model} ({self.family})")
        for col, just in (("kind", "left"), ("module", "left"), ("count", "right"), ("now runs", "left")):
            t.add_column(col, justify=just)
        for r in self.replaced:
            t.add_row(r.kind, r.target, str(r.count), r.op)
        for what, why in self.skipped:
            t.add_row("left alone", what, str(self.skipped_count.get((what, why), 1)), why, style="dim")
        for (kind, reason), n in sorted(self.fallbacks.items()):
            t.add_row("fallback", kind, _calls(n), reason, style="yellow")
        for c in self.choices.values():
            t.add_row("chose", c.kind, c.shape, c.describe(), style="green" if c.use_kernelkit else "magenta")
        for text in self.notes:
            t.add_row("note", "", "", text, style="cyan")
        return t

    def __rich__(self):
        return self.table()

    def __str__(self) -> str:
        rows = [(r.kind, r.target, str(r.count), r.op) for r in self.replaced]
        rows += [("left alone", what, str(self.skipped_count.get((what, why), 1)), why) for what, why in self.skipped]
        rows += [("fallback", kind, _calls(n), reason) for (kind, reason), n in sorted(self.fallbacks.items())]
        rows += [("note", "", "", text) for text in self.notes]
        head = ("kind", "module", "count", "now runs")
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(3)]
        lines = [f"kernelkit.patch: {self.model} ({self.family})"]
        for r in [head, *rows]:
            lines.append(f"  {r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}".rstrip())
        if self.choices:
            lines.append("  which path runs, per shape:")
            lines += [f"    {c.kind} {c.shape}: {c.describe()}" for c in self.choices.values()]
        return "\n".join(lines)


def _calls(n: int) -> str:
    return str(n) if n else "under torch.compile"
