"""`slurm-dlrm exporter`: Prometheus metrics from the stores (click glue over slurm_dlrm.exporter)."""

from __future__ import annotations

import errno
import json
import socket
import ssl
import threading

import click

from slurm_dlrm.commands.submit import site_option
from slurm_dlrm.errors import BadInput, DlrmError

DEFAULT_PORT = 9867  # slurm_dlrm.exporter.DEFAULT_PORT (not imported: --help stays light)


@click.command("exporter", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--port", type=click.IntRange(1, 65535), default=DEFAULT_PORT, show_default=True,
              help="TCP port to serve /metrics on.")
@click.option("--address", "--addr", "addr", default=None, metavar="ADDR",
              help="Address to listen on (default: the site's site.exporter_address, 127.0.0.1: this host "
                   "only; /metrics has no authentication, docs/admin.md \"Exporter security\").")
@click.option("--tls-cert", type=click.Path(dir_okay=False, exists=True), metavar="PEM",
              help="Serve HTTPS with this certificate (chain); needs --tls-key.")
@click.option("--tls-key", type=click.Path(dir_okay=False, exists=True), metavar="PEM",
              help="The certificate's private key.")
@click.option("--tls-client-ca", type=click.Path(dir_okay=False, exists=True), metavar="PEM",
              help="Require client certificates signed by this CA (mutual TLS: the only authentication "
                   "prometheus-client's server offers).")
@click.option("-a", "--all-users", is_flag=True,
              help="Every store under the site's store folder it can read (as acct --all-users), not only yours.")
@click.option("--once", is_flag=True, help="Print one scrape to stdout and exit (no server).")
@click.option("--json", "as_json", is_flag=True, help="With --once: the samples as a JSON array.")
@click.option("--slow-every", "slow_every_s", type=click.FloatRange(min=0), default=60.0, show_default=True,
              help="Recompute GPU-seconds and the histograms of a store at most this often (seconds).")
@site_option
def exporter(port: int, addr: str | None, tls_cert: str | None, tls_key: str | None, tls_client_ca: str | None,
             all_users: bool, once: bool, as_json: bool, slow_every_s: float, site_path: str | None) -> None:
    """Serve Prometheus metrics read from the stores (read-only) at scrape time.

    Jobs and packs by state; members, fenced / used / total GPU memory, SM and
    bandwidth use per GPU; GPU-seconds charged and at one job per GPU; OOMs,
    requeues, recoveries, re-packs; estimate error and queue wait histograms; each
    service's last round. A store it cannot read is skipped and counted in
    slurm_dlrm_store_errors_total{reason}. Metrics: docs/admin.md.

    \b
    Example:
      slurm-dlrm exporter                       # your store, http://127.0.0.1:9867/metrics
      slurm-dlrm exporter --all-users --port 9867 --site /etc/slurm-dlrm/site.toml
      slurm-dlrm exporter --once | grep slurm_dlrm_jobs
      slurm-dlrm exporter -a --address 0.0.0.0 --tls-cert c.pem --tls-key k.pem --tls-client-ca ca.pem
    """
    from slurm_dlrm import exporter as E
    from slurm_dlrm.site import load_site

    if as_json and not once:
        raise BadInput("--json: prints one scrape, give --once too")
    if (tls_cert is None) != (tls_key is None):
        raise BadInput("--tls-cert and --tls-key: give both, or neither")
    if tls_client_ca is not None and tls_cert is None:
        raise BadInput("--tls-client-ca: needs --tls-cert and --tls-key (mutual TLS)")
    site = load_site(site_path)
    addr = addr if addr is not None else site.exporter_address
    collector = E.StoreCollector(site, all_users=all_users, slow_every_s=slow_every_s)
    registry = E.make_registry(collector)
    if once:
        from prometheus_client import generate_latest

        text = generate_latest(registry).decode()
        if not as_json:
            click.echo(text, nl=False)
            return
        from prometheus_client.parser import text_string_to_metric_families

        click.echo(json.dumps([{"name": s.name, "labels": s.labels, "value": s.value}
                               for fam in text_string_to_metric_families(text) for s in fam.samples],
                              indent=1))
        return
    warm_s = collector.warm()  # before the port opens: no scrape pays for the history
    try:
        tls = None if tls_cert is None or tls_key is None else E.Tls(tls_cert, tls_key, tls_client_ca)
        E.serve(registry, port, addr, tls)
    except socket.gaierror as exc:
        raise BadInput(f"--addr: cannot listen on {addr!r}: {exc.strerror or exc}") from None
    except ssl.SSLError as exc:  # before OSError: it is one
        raise BadInput(f"--tls-cert/--tls-key: cannot load: {getattr(exc, 'reason', None) or exc}") from None
    except OSError as exc:
        why = "port in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        raise DlrmError(f"exporter: cannot listen on {addr}:{port}: {why}") from None
    click.echo(f"slurm-dlrm exporter: serving http{'s' if tls_cert else ''}://{addr}:{port}/metrics "
               f"({'all users' if all_users else 'your store'}; {collector.last_stores_read} store(s) "
               f"read in {1000 * warm_s:.0f} ms)", err=True)
    threading.Event().wait()  # the server runs in its own thread until SIGTERM/SIGINT
