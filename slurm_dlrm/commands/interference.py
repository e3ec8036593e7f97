"""`slurm-dlrm interference`: predict co-located speeds and score the model on measurements."""

from __future__ import annotations

import json
from typing import Any

import click

from slurm_dlrm.errors import BadInput

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
LABELS = {"model": "model", "model_refit_cv": "model refit, {k}-fold groups out",
          "model_refit_jobs_out": "model refit, {k}-fold jobs out",
          "learned_cv": "learned, {k}-fold groups out", "learned_jobs_out": "learned, {k}-fold jobs out",
          "baseline_speed_1": "baseline speed=1", "baseline_inverse_load": "baseline 1/sum(max(sm,bw))"}
SHORT = {"model": "model", "model_refit_cv": "refit-cv", "model_refit_jobs_out": "refit-jo",
         "learned_cv": "learn-cv", "learned_jobs_out": "learn-jo", "baseline_speed_1": "speed=1",
         "baseline_inverse_load": "1/sum"}


def _params_text(p: Any) -> str:
    return f"alpha={p.sm_contention:.3f} beta={p.membw_contention:.3f} gamma={p.per_client_overhead:.3f}"


def _params_dict(p: Any) -> dict[str, float]:
    return {"alpha": p.sm_contention, "beta": p.membw_contention, "gamma": p.per_client_overhead}


def _warn(notes: Any) -> None:
    for line in notes.warnings():
        click.echo(f"slurm-dlrm: warning: {line}", err=True)


@click.group(context_settings=CONTEXT)
def interference() -> None:
    """The co-location interference model: predict each member's speed relative to
    running alone from the solo profiles of the jobs sharing a GPU, and score it on
    measured co-locations (docs/packing.md, "Validating the model on your measurements").

    \b
    Example:
      slurm-dlrm interference predict -m sm=70,bw=20 -m sm=15,bw=60
      slurm-dlrm interference eval --samples docs/examples/colocation_samples.csv --refit
      slurm-dlrm interference fit --samples measured.csv -o model.json
    """


@interference.command(context_settings=CONTEXT)
@click.option("-m", "--member", "members", multiple=True, metavar="KEY=V,...",
              help="One member sharing the GPU: sm=PCT,bw=PCT[,mem_gib=G|mem_mib=M|mem_bytes=B][,job=NAME]. "
                   "Repeat per member.")
@click.option("-f", "--file", "file_path", type=click.Path(dir_okay=False), metavar="FILE",
              help="Groups of members from a CSV or JSON(-lines) file (the eval format; speeds optional).")
@click.option("--params", "params_text", metavar="ALPHA,BETA,GAMMA",
              help="Model constants (default: the built-in ones).")
@click.option("--model", "model_path", type=click.Path(dir_okay=False), metavar="MODEL",
              help="Predict with a learned model file (`interference fit`) instead of the formula.")
@click.option("--gpu-mem-gib", type=float, default=None, metavar="GIB",
              help="GPU memory: members whose memory does not fit all get speed 0.")
@click.option("--json", "as_json", is_flag=True, help="Print the predictions as JSON.")
def predict(members: tuple[str, ...], file_path: str | None, params_text: str | None, model_path: str | None,
            gpu_mem_gib: float | None, as_json: bool) -> None:
    """Predict each member's speed relative to running alone (1.0 = no slowdown).

    Profiles are what each job does alone on the GPU: SM utilisation % and memory-
    bandwidth utilisation % (and GPU memory, which only decides whether they fit).

    \b
    Example:
      slurm-dlrm interference predict -m sm=70,bw=20,mem_gib=8 -m sm=15,bw=60,mem_gib=20
      slurm-dlrm interference predict -f groups.csv --params 0.3,0.6,0.02 --json
      slurm-dlrm interference predict -f groups.csv --model model.json
    """
    from slurm_dlrm.interference_io import (
        MeasuredGroup,
        parse_member_arg,
        parse_params,
        read_groups,
    )
    from slurm_dlrm.packing.interference import DEFAULT_PARAMS, predict_colocated_speeds

    if bool(members) == bool(file_path):
        raise BadInput("give the members with --member (repeated) or --file, one of the two")
    if gpu_mem_gib is not None and not gpu_mem_gib > 0:
        raise BadInput(f"--gpu-mem-gib: must be > 0 (got {gpu_mem_gib})")
    if model_path and params_text:
        raise BadInput("give --params or --model, not both")
    params = parse_params(params_text) if params_text else DEFAULT_PARAMS
    model = None
    if model_path:
        from slurm_dlrm.interference_io import load_model

        model = load_model(model_path)
        params = model.params()
    if file_path:
        groups, notes = read_groups(file_path, need_speed=False)
        _warn(notes)
    else:
        parsed = [parse_member_arg(text, i) for i, text in enumerate(members)]
        groups = [MeasuredGroup("1", tuple(j for j, _ in parsed), tuple(p for _, p in parsed), None)]
    capacity = None if gpu_mem_gib is None else int(gpu_mem_gib * (1 << 30))
    out: list[dict[str, Any]] = []
    for g in groups:
        speeds = predict_colocated_speeds(g.members, params, capacity)
        if model is not None and all(v > 0 for v in speeds):
            speeds = model.predict_profiles(g.members)  # the full tree set when the profiles allow
        out.append({"group": g.name, "members": [
            {"job": job, "sm_util_pct": p.sm_util_pct, "membw_util_pct": p.membw_util_pct,
             "gpu_mem_bytes": p.gpu_mem_bytes, "predicted_speed": s,
             **({"measured_speed": g.speeds[i]} if g.speeds is not None else {})}
            for i, (job, p, s) in enumerate(zip(g.jobs, g.members, speeds, strict=True))]})
    if as_json:
        click.echo(json.dumps({"params": _params_dict(params), "model": model_path, "gpu_mem_bytes": capacity,
                               "groups": out}, indent=2))
        return
    measured = any(g.speeds is not None for g in groups)
    head = f"{'group':<10} {'job':<10} {'sm%':>6} {'bw%':>6} {'mem GiB':>8} {'predicted':>9}"
    click.echo(head + (f" {'measured':>8}" if measured else ""))
    for row in out:
        for m in row["members"]:
            line = (f"{str(row['group'])[:10]:<10} {str(m['job'])[:10]:<10} {m['sm_util_pct']:>6.1f} "
                    f"{m['membw_util_pct']:>6.1f} {m['gpu_mem_bytes'] / (1 << 30):>8.2f} {m['predicted_speed']:>9.3f}")
            if measured:
                line += f" {m['measured_speed']:>8.3f}" if "measured_speed" in m else f" {'-':>8}"
            click.echo(line)
    if model_path:
        click.echo(f"model: {model_path} (learned; prior {_params_text(params)})")
    else:
        click.echo(f"constants: {_params_text(params)}" + (" (defaults)" if params == DEFAULT_PARAMS else ""))


@interference.command("eval", context_settings=CONTEXT)
@click.option("-s", "--samples", "samples_path", type=click.Path(dir_okay=False), metavar="FILE",
              help="Measured co-locations: CSV (one row per member) or JSON lines (one group per line).")
@click.option("--store", "store_path", metavar="DB",
              help="Or: a store (file, or its folder); its ended packs' agent samples, as the service's "
                   "refit reads them.")
@click.option("--params", "params_text", metavar="ALPHA,BETA,GAMMA",
              help="Model constants to score (default: the built-in ones); --refit starts from them.")
@click.option("--refit", is_flag=True,
              help="Also refit the constants: k-fold cross-validated error, and the constants fitted on all.")
@click.option("--learned", is_flag=True,
              help="Also the learned model (gradient-boosted trees), trained inside each fold; implies --refit.")
@click.option("--folds", type=int, default=None, metavar="K",
              help="Folds for --refit/--learned (groups out and jobs out; default 5, fewer if there are fewer).")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def eval_cmd(samples_path: str | None, store_path: str | None, params_text: str | None, refit: bool,
             learned: bool, folds: int | None, as_json: bool) -> None:
    """Score the interference model on measured co-located speeds.

    Prints the mean, median and p90 absolute error of the predicted relative speed, its
    bias (mean of predicted - measured: > 0 is optimistic), the same for each group's
    summed speed (the GPU's throughput) and the errors per group size, beside two naive
    baselines (speed 1.0 for everyone; min(1, 1/sum of each
    member's max(sm, bw) fraction)). With --refit, also the error of constants refitted
    on K-1 folds and scored on the held-out fold, and the constants fitted on all data,
    both leave-groups-out and leave-jobs-out (every group containing a held-out job is
    left out of the fit: the error for a job never seen). --learned adds the learned
    model the same two ways. File formats: docs/packing.md, "Validating the model on
    your measurements".

    \b
    Example:
      slurm-dlrm interference eval --samples docs/examples/colocation_samples.csv
      slurm-dlrm interference eval --samples measured.jsonl --refit --folds 10 --json
      slurm-dlrm interference eval --samples measured.csv --refit --learned
      slurm-dlrm interference eval --store ~/.local/share/slurm-dlrm/store.sqlite --refit
    """
    from slurm_dlrm.interference_io import parse_params
    from slurm_dlrm.packing.interference import DEFAULT_PARAMS
    from slurm_dlrm.packing.interference_eval import evaluate

    refit = refit or learned
    if folds is not None and not refit:
        raise BadInput("--folds: only with --refit or --learned")
    params = parse_params(params_text) if params_text else DEFAULT_PARAMS
    multi, source = _read_multi(samples_path, store_path)
    k = 0
    if refit:
        if folds is not None and not 2 <= folds <= len(multi):
            raise BadInput(f"--folds: must be between 2 and the number of groups, {len(multi)} (got {folds})")
        if folds is None and len(multi) < 2:
            raise BadInput(f"{source}: --refit needs at least 2 co-location groups to cross-validate")
        k = folds if folds is not None else min(5, len(multi))
    result = evaluate([g.sample() for g in multi], params, k, learned=learned)
    from slurm_dlrm.packing.pairwise import choose_planner_model

    choice = choose_planner_model([g.sample() for g in multi], params, learned=learned)
    if as_json:
        out = result.as_dict()
        out["source"] = source
        out["default_params"] = params == DEFAULT_PARAMS
        out["planner"] = {"model": choice.name, "how": choice.how, "held_out_mae": choice.held_out_mae,
                          "reason": choice.reason}
        click.echo(json.dumps(out, indent=2))
        return
    sizes = ", ".join(f"{size}: {per['model'].count // size}" for size, per in sorted(result.by_size.items()))
    click.echo(f"samples: {result.groups} co-location groups, {result.members} members "
               f"(groups by size {sizes}) from {source}")
    click.echo(f"constants: {_params_text(params)}" + (" (defaults)" if params == DEFAULT_PARAMS else " (given)"))
    click.echo("")
    def rows(stats: Any) -> None:
        for name in result.order:
            st = stats[name]
            click.echo(f"{LABELS[name].format(k=k):<30} {st.mae:>6.3f} {st.median_abs:>7.3f} {st.p90_abs:>6.3f} "
                       f"{st.bias:>+7.3f} {st.max_abs:>6.3f}")

    click.echo("error of the predicted relative speed (predicted - measured), over members:")
    click.echo(f"{'predictor':<30} {'MAE':>6} {'median':>7} {'p90':>6} {'bias':>7} {'max':>6}")
    rows(result.overall)
    click.echo("")
    click.echo("error of each group's summed speed (the GPU's throughput in solo jobs), over groups:")
    rows(result.throughput)
    click.echo("")
    click.echo("MAE of the relative speed by group size:")
    click.echo(f"{'size':>4} {'groups':>6} {'members':>7} " + " ".join(f"{SHORT[n]:>8}" for n in result.order))
    for size, per in sorted(result.by_size.items()):
        n = per["model"].count
        click.echo(f"{size:>4} {n // size:>6} {n:>7} " + " ".join(f"{per[name].mae:>8.3f}" for name in result.order))
    if result.fitted is not None and result.fitted_in_sample is not None:
        click.echo("")
        click.echo(f"refit on all {result.groups} groups: {_params_text(result.fitted)} "
                   f"(in-sample MAE {result.fitted_in_sample.mae:.3f})")
        for i, p in enumerate(result.fold_params):
            click.echo(f"  fold {i + 1} of {k} held out: {_params_text(p)}")
    if refit and "model_refit_jobs_out" not in result.overall:
        click.echo(f"(no leave-jobs-out figures: fewer than {k} distinct job profiles)")
    click.echo("")
    click.echo("which model the planner would use (docs/packing.md \"Interference that earns its place\"), "
               f"{choice.how}: " + ", ".join(f"{n} {v:.3f}" for n, v in choice.held_out_mae.items()))
    click.echo(f"planner: {choice.reason}")


def _read_multi(samples_path: str | None, store_path: str | None) -> tuple[list[Any], str]:
    """The multi-member groups of --samples FILE or --store DB (BadInput if none)."""
    from slurm_dlrm.interference_io import read_groups, read_store_groups

    if bool(samples_path) == bool(store_path):
        raise BadInput("give --samples FILE or --store DB, one of the two")
    if samples_path:
        groups, notes = read_groups(samples_path)
        _warn(notes)
        source = samples_path
    else:
        assert store_path is not None
        groups = read_store_groups(store_path)
        source = f"store {store_path}"
    multi = [g for g in groups if len(g.members) > 1]
    if len(multi) < len(groups):
        click.echo(f"slurm-dlrm: note: {len(groups) - len(multi)} single-member group(s) skipped "
                   "(nothing to predict: alone is speed 1.0)", err=True)
    if not multi:
        raise BadInput(f"{source}: no co-location group with two or more members")
    return multi, source


@interference.command(context_settings=CONTEXT)
@click.option("-s", "--samples", "samples_path", type=click.Path(dir_okay=False), metavar="FILE",
              help="Measured co-locations (the eval format: CSV or JSON lines).")
@click.option("--store", "store_path", metavar="DB",
              help="Or: a store (file, or its folder); its ended packs' agent samples.")
@click.option("-o", "--output", "output", required=True, type=click.Path(dir_okay=False), metavar="MODEL",
              help="The model file to write (replaced atomically, mode 0600).")
@click.option("--params", "params_text", metavar="ALPHA,BETA,GAMMA",
              help="The analytic prior's constants (a feature of the model; default: the built-in ones).")
@click.option("--folds", type=int, default=5, show_default=True, metavar="K",
              help="Cross-validation folds for the errors stored in the file (0: skip, faster).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def fit(samples_path: str | None, store_path: str | None, output: str, params_text: str | None, folds: int,
        as_json: bool) -> None:
    """Fit the learned co-location model and write it to a model file.

    The file holds the schema version, the feature list, the training size and the
    cross-validated errors (leave-jobs-out and leave-groups-out, beside the analytic
    model and the better naive baseline on the same data). Point the site key
    adapt.interference_model at it, or give it to `simulate --plan-model learned:FILE`.

    \b
    Example:
      slurm-dlrm interference fit --samples measured.csv -o ~/.local/share/slurm-dlrm/interference.json
      slurm-dlrm interference fit --store ~/.local/share/slurm-dlrm -o model.json --folds 0 --json
    """
    import time

    from slurm_dlrm.interference_io import parse_params, save_model
    from slurm_dlrm.packing.interference import DEFAULT_PARAMS
    from slurm_dlrm.packing.learned import fit_learned

    params = parse_params(params_text) if params_text else DEFAULT_PARAMS
    multi, source = _read_multi(samples_path, store_path)
    samples = [g.sample() for g in multi]
    if folds and not 2 <= folds <= len(samples):
        raise BadInput(f"--folds: must be 0 or between 2 and the number of groups, {len(samples)} (got {folds})")
    cv = cv_errors(samples, params, folds) if folds else {}
    t0 = time.perf_counter()
    try:
        model = fit_learned(samples, params, info={"cv": cv, "fitted_from": source})
    except ValueError as exc:
        raise BadInput(f"{source}: {exc}") from None
    fit_s = time.perf_counter() - t0
    save_model(model, output)
    summary = {"model": output, "source": source, "training_groups": model.info["training_groups"],
               "training_members": model.info["training_members"],
               "features": list(model.as_dict()["features"]), "fit_s": round(fit_s, 3), "cv": cv}
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    click.echo(f"fitted on {summary['training_groups']} co-location groups ({summary['training_members']} members) "
               f"from {source} in {fit_s:.1f} s")
    click.echo(f"features: {', '.join(summary['features'])}")
    if cv:
        click.echo(f"{cv['folds']}-fold MAE of the relative speed: learned jobs out {cv['learned_jobs_out_mae']:.3f}, "
                   f"groups out {cv['learned_groups_out_mae']:.3f}; analytic {cv['analytic_mae']:.3f}; "
                   f"better naive baseline {cv['naive_mae']:.3f}")
    click.echo(f"wrote {output}")


def cv_errors(samples: list[Any], params: Any, folds: int) -> dict[str, Any]:
    """The figures a model file carries (and the service compares before it switches)."""
    from slurm_dlrm.packing.interference_eval import learned_cross_validation

    return learned_cross_validation(samples, params, folds)
