"""`slurm-dlrm serve`: the user's packing service (foreground, --daemon, status, stop)."""

from __future__ import annotations

import json
import time

import click

from slurm_dlrm.commands.submit import site_option
from slurm_dlrm.errors import DlrmError


@click.group("serve", invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--daemon", is_flag=True, help="Run in the background (own session, log in the store folder); "
              "print its pid once it holds the lock.")
@click.option("--round-seconds", type=click.FloatRange(min=0.1), default=None,
              help="Dispatch round period (default: the site's packing.round_seconds).")
@click.option("--idle-exit", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Exit after this many seconds with no pending or running job (0: never).")
@click.option("--policy", type=click.Choice(["exclusive", "first-fit", "mem-best-fit", "complementary", "exact"]),
              default=None, help="Packing policy (default: the site's packing.policy).")
@click.option("--log-file", type=click.Path(dir_okay=False), default=None,
              help="Log to FILE (with times), rotated at 10 MiB, 3 old files kept; stdout and stderr go there too. "
                   "--daemon and submit use <store>/service.log; without it the log goes to stderr "
                   "(the journal under systemd).")
@click.option("--slurm-job", is_flag=True, hidden=True,
              help="Run as the [service] run_as = \"slurm-job\" batch job (queues its successor).")
@site_option
@click.pass_context
def serve(ctx: click.Context, daemon: bool, round_seconds: float | None, idle_exit: float, policy: str | None,
          log_file: str | None, slurm_job: bool, site_path: str | None) -> None:
    """Run your packing service: it packs your pending jobs into Slurm jobs.

    One service per user (a lock in your store folder). `slurm-dlrm submit` starts
    it when needed, so running it by hand is optional. Each round it reads agent
    reports and Slurm's job states, then plans and submits packs.

    \b
    Example:
      slurm-dlrm serve                    # foreground, Ctrl-C to stop
      slurm-dlrm serve --daemon --round-seconds 2
      slurm-dlrm serve status
      slurm-dlrm serve stop
    """
    if ctx.invoked_subcommand is not None:
        return
    from slurm_dlrm.service.run import serve_forever
    from slurm_dlrm.site import load_site
    from slurm_dlrm.store.store import current_user

    site = load_site(site_path)
    user = current_user()
    if daemon:
        import os

        from slurm_dlrm.service.daemon import (
            elsewhere,
            running_pid,
            spawn_service,
            wait_until_running,
        )
        from slurm_dlrm.service.submit import service_paths

        paths = service_paths(site, user)
        pid = running_pid(paths)
        if pid is not None:
            host = elsewhere(paths)
            click.echo(f"packing service already running (pid {pid})" + (f" on host {host}" if host else ""))
            return
        args = ["--idle-exit", str(idle_exit)]
        if round_seconds is not None:
            args += ["--round-seconds", str(round_seconds)]
        if policy is not None:
            args += ["--policy", policy]
        env = dict(os.environ)
        if site.path:
            env["SLURM_DLRM_SITE"] = os.path.abspath(site.path)
        spawn_service(paths, args, env=env)
        pid = wait_until_running(paths, timeout_s=30.0)
        if pid is None:
            raise DlrmError(f"the packing service did not start; see {paths.log}")
        click.echo(f"packing service running (pid {pid}); log: {paths.log}")
        return
    from pathlib import Path

    serve_forever(site, user, round_seconds=round_seconds, idle_exit_s=idle_exit, policy=policy,
                  log_file=Path(log_file).resolve() if log_file else None, slurm_job=slurm_job)


@serve.command("status", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@site_option
def status(as_json: bool, site_path: str | None) -> None:
    """Show whether your packing service runs and what its last round saw.

    \b
    Example:
      slurm-dlrm serve status --json

    The service runs on one login node; the store folder (your home) may be seen from
    others. `host` names where it runs; `stop` works only there.
    Exit code 0 if it runs, 1 if not.
    """
    from slurm_dlrm.service.daemon import read_status, running_pid, this_host
    from slurm_dlrm.service.hosts import writer_elsewhere
    from slurm_dlrm.service.submit import service_paths
    from slurm_dlrm.site import load_site
    from slurm_dlrm.store.store import current_user

    paths = service_paths(load_site(site_path), current_user())
    pid = running_pid(paths)
    st = read_status(paths)
    lease = writer_elsewhere(paths)
    if lease is not None:  # its flock may not be seen from this host; its live lease is
        pid = pid if pid is not None else lease.pid
        st = {**st, "host": lease.host}
    here = this_host()
    host = st.get("host") or here  # a status written before hosts were: this host's
    if as_json:
        shown = {k: v for k, v in st.items() if k != "pid"} if pid is not None else {}
        click.echo(json.dumps({"running": pid is not None, "pid": pid, **shown,
                               "host": host if pid is not None else None, "this_host": here,
                               "on_this_host": pid is not None and host == here},
                              indent=1, sort_keys=True))
    elif pid is None:
        # The lock is not seen held from here. A status file of another host, fresh,
        # means the lock is not shared between hosts (say, NFS without lock support).
        last = st.get("last_round_t")
        seen = (f" (last seen on host {host}, {time.time() - float(last):.0f} s ago)"
                if host != here and isinstance(last, int | float) else "")
        click.echo(f"packing service: not running{seen}")
    else:
        age = time.time() - float(st.get("last_round_t") or time.time())
        slurm = "ok" if st.get("slurm_ok", True) else (
            f"unreachable ({st.get('slurm_error')}); retry in {st.get('slurm_retry_in_s')} s")
        where = f"on host {host}" + ("" if host == here else f", not this one ({here})")
        click.echo(f"packing service: running {where} (pid {pid}), policy {st.get('policy', '?')}, "
                   f"{st.get('rounds', 0)} rounds, last {age:.0f} s ago; Slurm {slurm}"
                   + (f"; SLURM_CONF={st.get('slurm_conf') or '(unset)'}" if "slurm_conf" in st else ""))
        click.echo(f"interference model: {st.get('interference_model', 'analytic defaults')}")
    if pid is None:
        raise SystemExit(1)


@serve.command("stop", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--timeout", "timeout_s", type=float, default=60.0, show_default=True,
              help="Seconds to wait for the current round to finish.")
@site_option
def stop(timeout_s: float, site_path: str | None) -> None:
    """Stop your packing service (after its current round). Jobs are not touched.

    Only on the host it runs on (`serve status` names it): elsewhere it is refused,
    exit 1, and nothing is signalled.

    \b
    Example:
      slurm-dlrm serve stop
    """
    from slurm_dlrm.service import daemon
    from slurm_dlrm.service.submit import service_paths
    from slurm_dlrm.site import load_site
    from slurm_dlrm.store.store import current_user

    paths = service_paths(load_site(site_path), current_user())
    try:
        pid = daemon.stop(paths, timeout_s)
    except TimeoutError as exc:
        raise DlrmError(str(exc)) from None
    click.echo("packing service: not running" if pid is None else f"packing service (pid {pid}) stopped")


@serve.command("install-unit", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--print", "print_only", is_flag=True, help="Print the unit to stdout; install nothing.")
@click.option("--dir", "unit_dir", type=click.Path(file_okay=False), default=None,
              help="Install into DIR (default: $XDG_CONFIG_HOME/systemd/user, else ~/.config/systemd/user).")
@click.option("--env", "extra_env", multiple=True, metavar="NAME",
              help="Also carry this variable's current value into the unit (repeatable); PATH, SLURM_CONF "
                   "and SLURM_DLRM_SITE are carried when set.")
@click.option("--json", "as_json", is_flag=True, help="Print where the unit went as JSON.")
@site_option
def install_unit(print_only: bool, unit_dir: str | None, extra_env: tuple[str, ...], as_json: bool,
                 site_path: str | None) -> None:
    """Install your packing service as a systemd user unit (slurm-dlrm.service).

    The unit runs `slurm-dlrm serve` in the foreground with this Python, restarts it
    (Restart=always, 30 s) and logs to the journal. systemd does not see your shell's
    environment, so PATH, SLURM_CONF and SLURM_DLRM_SITE are written into the unit as
    they are now (--site FILE: that file). Run it again after changing them.

    \b
    Example:
      slurm-dlrm serve install-unit && systemctl --user daemon-reload \\
        && systemctl --user enable --now slurm-dlrm.service
      slurm-dlrm serve install-unit --print --env LD_LIBRARY_PATH
      journalctl --user -u slurm-dlrm.service      # its log
      systemctl --user stop slurm-dlrm.service     # stop it (serve stop: systemd restarts it)

    It keeps running after you log out only with lingering (`loginctl enable-linger`,
    where the site allows it). Exit code 0 on success, 2 for a value systemd cannot take.
    """
    import os
    import sys
    from pathlib import Path

    from slurm_dlrm.service.unit import UNIT_NAME, install_unit, render_unit, user_unit_dir
    from slurm_dlrm.store.store import current_user

    env = dict(os.environ)
    if site_path:
        env["SLURM_DLRM_SITE"] = site_path
    text = render_unit(user=current_user(), python=sys.executable, env=env, extra_env=extra_env)
    if print_only:
        click.echo(text, nl=False)
        return
    path, changed = install_unit(text, Path(unit_dir) if unit_dir else user_unit_dir(env))
    start = f"systemctl --user daemon-reload && systemctl --user enable --now {UNIT_NAME}"
    if as_json:
        click.echo(json.dumps({"unit": str(path), "changed": changed, "start": start}, indent=1, sort_keys=True))
        return
    click.echo(f"{'wrote' if changed else 'unchanged'}: {path}")
    click.echo(f"start it now and at every login: {start}")
