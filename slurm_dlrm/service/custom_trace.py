"""Custom models (`custom_module: "pkg.mod:factory"`): checked at submit, traced by the service.

The analytic estimate covers torchrec's DLRM only; a custom module is estimated by
tracing it (slurm_dlrm/estimate/traced.py), which needs torch. `submit` stays
torch-free (docs/service.md: its time is interpreter start-up), so:

* at submit, `check_custom_module` finds the module's source without importing or
  running anything of it (importlib's finders; a dotted name's parents are looked up in
  their folders, not imported) and reads it with `ast` for a top-level binding of the
  factory's name. A missing module or factory is refused with the line `estimate`
  prints, exit 2, nothing recorded. What only running the factory shows (it raises,
  it returns no module, its forward fails on meta tensors) comes next:
* the job is recorded PENDING with the estimate marked `pending_trace` (its analytic
  figures are placeholders: `queue` says "estimating"), and the service's next round
  traces it in a child process (`python -m slurm_dlrm.service.custom_trace`, with the
  submitting process's import path) before any plan sees it. The traced estimate
  replaces the placeholder (and the memory requests, so the fence is the trace's); a
  factory that fails makes the job FAILED with the same one line `estimate` prints.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import json
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from slurm_dlrm.errors import SpecError

log = logging.getLogger(__name__)

PENDING_TRACE = "pending_trace"  # key in the job's estimate document while it waits
ESTIMATING_REASON = "estimating"
TRACE_TIMEOUT_S = 600.0


# ---------------------------------------------------------------- at submit (no torch)


def check_custom_module(spec: Any, source: str | None = None, search_path: Sequence[str] | None = None) -> None:
    """Raise SpecError (the text `estimate SOURCE` gives) if the module or factory is missing."""
    mod_name, _, attr = str(spec.custom_module).partition(":")
    source = spec.source if source is None else source
    origin = _find_source(mod_name, source, search_path)
    if origin is None or not origin.endswith(".py"):
        return  # an extension module or a namespace package: only importing tells
    try:
        with open(origin, "rb") as f:
            tree = ast.parse(f.read(), filename=origin)
    except SyntaxError as exc:
        raise SpecError("custom_module", f"cannot import {mod_name}: {exc.msg} ({origin}, line {exc.lineno})",
                        source) from None
    except OSError:
        return
    names = _top_level_names(tree.body)
    if attr not in names and "__getattr__" not in names and "*" not in names:
        raise SpecError("custom_module", f"{mod_name} has no callable {attr}", source)


def _find_source(mod_name: str, source: str | None, search_path: Sequence[str] | None) -> str | None:
    parts = mod_name.split(".")
    locations: list[str] | None = list(search_path) if search_path is not None else None
    found = None
    for i, part in enumerate(parts):
        name = ".".join(parts[: i + 1])
        if i == 0 and locations is None:
            found = importlib.util.find_spec(part)  # a top-level name: nothing is imported
        else:
            found = importlib.machinery.PathFinder.find_spec(part, locations)
        if found is None:
            raise SpecError("custom_module", f"cannot import {mod_name}: No module named {name!r}", source)
        if i < len(parts) - 1:
            if found.submodule_search_locations is None:
                raise SpecError("custom_module", f"cannot import {mod_name}: No module named {mod_name!r}; "
                                f"{name!r} is not a package", source)
            locations = list(found.submodule_search_locations)
    return found.origin if found is not None and found.has_location else None


def _top_level_names(body: list[ast.stmt]) -> set[str]:
    """Names a module binds at its top level (also inside if/try/with blocks)."""
    out: set[str] = set()
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                out.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for a in node.names:
                out.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.If | ast.Try | ast.With):
            for block in ("body", "orelse", "finalbody"):
                out |= _top_level_names(getattr(node, block, []) or [])
            for h in getattr(node, "handlers", []):
                out |= _top_level_names(h.body)
    return out


def pending_trace_estimate(estimate: dict[str, Any], source: str, search_path: Sequence[str]) -> dict[str, Any]:
    """The estimate document recorded at submit: placeholders plus what tracing needs."""
    return {**estimate, "method": "pending-trace",
            PENDING_TRACE: {"source": source, "sys_path": [p for p in search_path if p]}}


def submit_search_path(cwd: str) -> list[str]:
    """This process's import path, absolute (what `estimate` run here would import from)."""
    return [os.path.abspath(os.path.join(cwd, p)) if p else cwd for p in sys.path]


# ---------------------------------------------------------------- in the service


def needs_trace(job: Any) -> bool:
    est = job.estimate or {}
    return PENDING_TRACE in est


def trace_job(job: Any, gpu: Any, python: str = sys.executable) -> tuple[dict[str, Any] | None, str]:
    """Trace one recorded job for `gpu` (a site GpuModel) in a child process. Returns
    (estimate dict, "") or (None, the error line)."""
    info = (job.estimate or {})[PENDING_TRACE]
    return trace_spec(job.spec, info.get("source"), gpu, info.get("sys_path") or [], python)


def trace_spec(spec_data: dict[str, Any], source: str | None, gpu: Any, search_path: Sequence[str],
               python: str = sys.executable) -> tuple[dict[str, Any] | None, str]:
    """Trace a spec in a child process with `search_path` as its import path."""
    import dataclasses

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in search_path if p)
    payload = json.dumps({"spec": spec_data, "source": source, "gpu": dataclasses.asdict(gpu)})
    try:
        proc = subprocess.run(  # noqa: S603 - our own interpreter and module, no shell
            [python, "-m", "slurm_dlrm.service.custom_trace"], input=payload, capture_output=True, text=True,
            env=env, timeout=TRACE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"custom_module: tracing took more than {TRACE_TIMEOUT_S:.0f} s"
    if proc.returncode == 0:
        return dict(json.loads(proc.stdout)), ""
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    line = next((ln for ln in reversed(lines) if ln.startswith("slurm-dlrm: error: ")), lines[-1] if lines else "")
    return None, line.removeprefix("slurm-dlrm: error: ") or f"tracing failed (exit {proc.returncode})"


def _main() -> int:
    """Child: spec JSON on stdin -> traced estimate JSON on stdout, or the error line."""
    from slurm_dlrm.errors import DlrmError
    from slurm_dlrm.site import GpuModel
    from slurm_dlrm.spec import parse_spec

    req = json.loads(sys.stdin.read())
    try:
        spec = parse_spec(req["spec"], req.get("source"))
        gpu = GpuModel(**req["gpu"])
        from slurm_dlrm.estimate.traced import estimate_traced

        est = estimate_traced(spec, gpu)
    except DlrmError as exc:
        print(f"slurm-dlrm: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(est.to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
