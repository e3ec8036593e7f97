"""The rendered job_submit.lua, run in the Lua that Slurm's job_submit/lua plugin links
(5.1 on Debian 12) against a mocked `slurm` table that behaves like the plugin's."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_dlrm.admin.marker import format_marker, parse_marker
from slurm_dlrm.admin.render import lua_str, render_site
from slurm_dlrm.errors import BadInput
from slurm_dlrm.site import REPO_SITE_FILE, parse_site

LUA = shutil.which("lua5.1") or shutil.which("lua")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(autouse=True)
def _need_lua():
    if LUA is None:
        # CI runs scripts/setup.sh, which installs it: missing there is a failure.
        (pytest.fail if IN_CI else pytest.skip)("lua5.1 not installed (scripts/setup.sh installs it)")

NO_VAL = 4294967294
OK, ACCESS_DENIED, MISSING_SIZE, INVALID_GRES = 0, 2002, 2008, 2072
USER_UID, SLURM_UID = 1000, 64030


def site_raw() -> dict[str, Any]:
    raw = tomllib.loads(REPO_SITE_FILE.read_text())
    raw["partitions"][0].update(min_mps_share=10, max_gpus_per_job=6)
    raw["partitions"].append({"name": "debug", "nodes": "node1", "enforce": False})
    raw["slurm"]["slurm_user"] = "slurmsvc"
    return raw


def to_lua(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return lua_str(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"[{lua_str(k)}] = {to_lua(v)}" for k, v in value.items() if v is not None) + "}"
    raise TypeError(value)


HARNESS = r"""
local msgs
-- What Slurm 22.05's job_submit/lua registers (only these ESLURM names, see render.py).
slurm = {SUCCESS = 0, ERROR = -1, NO_VAL = 4294967294, NO_VAL16 = 65534,
  ESLURM_ACCESS_DENIED = 2002, ESLURM_JOB_MISSING_SIZE_SPECIFICATION = 2008,
  ESLURM_INVALID_ACCOUNT = 2045, ESLURM_INVALID_LICENSES = 2048,
  log_user = function(fmt, ...) msgs[#msgs + 1] = string.format(fmt, ...) end,
  log_info = function() end, log_debug = function() end, log_error = function() end}
local loaded = dofile(SCRIPT)
assert(loaded == slurm.SUCCESS, "script did not return slurm.SUCCESS")
slurm_dlrm.passwd_file = PASSWD
local function run(name, desc, rec, uid)
  msgs = {}
  -- The plugin reads unset numbers as NO_VAL.
  if desc.min_nodes == nil then desc.min_nodes = slurm.NO_VAL end
  local rc
  if rec == nil then
    rc = slurm_job_submit(desc, {}, uid)
  else
    rc = slurm_job_modify(desc, rec, {}, uid)
  end
  local msg = table.concat(msgs, "\n"):gsub("\\", "\\\\"):gsub("\n", "\\n")
  io.write(name, "\t", tostring(rc), "\t", msg, "\n")
end
"""


def run_cases(tmp_path: Path, cases: list[tuple[str, dict, dict | None, int]], raw=None,
              site_script: str | None = None) -> dict[str, tuple[int, str]]:
    """Run the cases through the rendered job_submit.lua, or with `site_script` through a
    site's own job_submit.lua that calls the rendered module (MODULE in it: its path)."""
    files = {f.name: f.text for f in render_site(parse_site(raw or site_raw()))}
    script = tmp_path / "job_submit.lua"
    if site_script is None:
        script.write_text(files["job_submit.lua"])
    else:
        module = tmp_path / "slurm_dlrm_submit.lua"
        module.write_text(files["slurm_dlrm_submit.lua"])
        script.write_text(site_script.replace("MODULE", lua_str(module)))
    passwd = tmp_path / "passwd"
    passwd.write_text(f"root:x:0:0::/root:/bin/sh\nslurmsvc:x:{SLURM_UID}:{SLURM_UID}::/:/bin/false\n")
    lines = [f"local SCRIPT = {lua_str(script)}", f"local PASSWD = {lua_str(passwd)}", HARNESS]
    for name, desc, rec, uid in cases:
        lines.append(f"run({lua_str(name)}, {to_lua(desc)}, {'nil' if rec is None else to_lua(rec)}, {uid})")
    driver = tmp_path / "driver.lua"
    driver.write_text("\n".join(lines) + "\n")
    # Bytes, not text=True: universal newlines would turn a \r in a message into a line end.
    proc = subprocess.run([LUA, str(driver)], capture_output=True, timeout=30)  # noqa: S603
    assert proc.returncode == 0, proc.stderr
    out = {}
    stdout = proc.stdout.decode("utf-8", "surrogateescape")
    for line in stdout.split("\n")[:-1]:  # not splitlines(): a message may hold \r, \x1c, ...
        name, rc, msg = line.split("\t", 2)
        out[name] = (int(rc), re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), msg))
    assert len(out) == len(cases)
    return out


NO_PACK = format_marker("no-pack", gpu_mem_mib=3000, job_id=12)
PACK = format_marker("pack", pack_id=7)
WRAPPER_MPS = {"partition": "dlrm", "comment": NO_PACK, "min_mem_per_node": 4096, "tres_per_node": "gres:mps:40"}
WRAPPER_PACK = {"partition": "dlrm", "comment": PACK, "min_mem_per_node": 8192, "tres_per_node": "gres:gpu:2",
                "min_nodes": 2}

SUBMIT_CASES = [
    # name, job_desc, expected rc, text expected in the message
    ("plain", {"partition": "dlrm"}, ACCESS_DENIED, "no slurm-dlrm marker"),
    ("plain-default-partition", {}, ACCESS_DENIED, "no slurm-dlrm marker"),
    ("plain-multi-partition", {"partition": "debug,dlrm"}, ACCESS_DENIED, "partition dlrm"),
    ("plain-other-partition", {"partition": "debug"}, OK, ""),
    ("plain-unknown-partition", {"partition": "cpu"}, OK, ""),
    ("wrapper-no-pack-mps", WRAPPER_MPS, OK, ""),
    ("wrapper-pack", WRAPPER_PACK, OK, ""),
    ("wrapper-typed-gpu", dict(WRAPPER_MPS, tres_per_node="gres:gpu:h100:1"), OK, ""),
    ("wrapper-gpus-per-job", dict(WRAPPER_MPS, tres_per_node=None, tres_per_job="gres:gpu:6"), OK, ""),
    ("mem-per-cpu", dict(WRAPPER_MPS, min_mem_per_node=None, min_mem_per_cpu=500), OK, ""),
    ("mem-per-gpu", dict(WRAPPER_MPS, min_mem_per_node=None, mem_per_tres="gres:gpu:1000"), OK, ""),
    ("no-memory", dict(WRAPPER_MPS, min_mem_per_node=None), MISSING_SIZE, "no memory request"),
    ("mem-zero", dict(WRAPPER_MPS, min_mem_per_node=0), MISSING_SIZE, "--mem=0"),
    ("no-gres", dict(WRAPPER_MPS, tres_per_node=None), INVALID_GRES, "no GPU request"),
    ("mps-too-small", dict(WRAPPER_MPS, tres_per_node="gres:mps:5"), INVALID_GRES, "outside 10..100"),
    ("mps-too-big", dict(WRAPPER_MPS, tres_per_node="gres:mps:101"), INVALID_GRES, "outside 10..100"),
    ("mps-and-gpu", dict(WRAPPER_MPS, tres_per_job="gres:gpu:1"), INVALID_GRES, "not both"),
    ("shard", dict(WRAPPER_MPS, tres_per_node="gres:shard:2"), INVALID_GRES, "shard"),
    ("gpus-per-node-too-many", dict(WRAPPER_PACK, tres_per_node="gres:gpu:5"), INVALID_GRES, "1..4 GPUs per node"),
    ("gpus-in-all-too-many", dict(WRAPPER_PACK, min_nodes=4), INVALID_GRES, "8 GPUs in all is outside 1..6"),
    ("gpus-per-job-too-many", dict(WRAPPER_MPS, tres_per_node=None, tres_per_job="gres:gpu:7"), INVALID_GRES,
     "outside 1..6"),
    ("gpus-per-task", dict(WRAPPER_MPS, tres_per_node=None, tres_per_task="gres:gpu:1"), INVALID_GRES,
     "not per socket or task"),
    ("garbled-gres", dict(WRAPPER_MPS, tres_per_node="gres:gpu:h100:x2"), INVALID_GRES, "cannot read"),
    ("marker-no-mem", dict(WRAPPER_MPS, comment="slurm-dlrm:mode=no-pack"), ACCESS_DENIED, "gpu_mem_mib"),
    ("marker-mem-too-big", dict(WRAPPER_MPS, comment=format_marker("no-pack", gpu_mem_mib=90000)), ACCESS_DENIED,
     "exceeds the 81920 MiB"),
    ("marker-bad-mode", dict(WRAPPER_MPS, comment="slurm-dlrm:mode=solo"), ACCESS_DENIED, "mode=no-pack"),
    ("marker-bad-field", dict(WRAPPER_MPS, comment="slurm-dlrm:mode=pack;rm -rf"), ACCESS_DENIED, "bad field"),
    ("marker-pack-no-id", dict(WRAPPER_PACK, comment="slurm-dlrm:mode=pack"), ACCESS_DENIED, "pack_id"),
    ("marker-unknown-key-ok", dict(WRAPPER_MPS, comment=NO_PACK + ",future_key=x"), OK, ""),
    ("marker-pack-on-mps", dict(WRAPPER_MPS, comment=PACK), INVALID_GRES, "a pack (mode=pack in --comment)"),
    # Issue 32 item 2: every entry of a gres name counts (the last one alone let these pass).
    ("typed-gpus-per-node-summed", dict(WRAPPER_PACK, tres_per_node="gres:gpu:big:9,gres:gpu:small:1"),
     INVALID_GRES, "--gres=gpu:10 is outside 1..4"),
    ("typed-gpus-per-job-summed", dict(WRAPPER_MPS, tres_per_node=None, tres_per_job="gres:gpu:a:50,gres:gpu:b:1"),
     INVALID_GRES, "51 GPUs in all is outside 1..6"),
    ("typed-mps-summed", dict(WRAPPER_MPS, tres_per_node="gres:mps:a:500,gres:mps:b:50"), INVALID_GRES,
     "--gres=mps:550 is outside 10..100"),
    ("typed-mps-summed-24.11", dict(WRAPPER_MPS, tres_per_node="gres/mps:a:60,gres/mps:b:50"), INVALID_GRES,
     "--gres=mps:110 is outside 10..100"),
    ("typed-gpus-within", dict(WRAPPER_PACK, tres_per_node="gres:gpu:a:1,gres/gpu:b:1"), OK, ""),
    ("typed-mps-within", dict(WRAPPER_MPS, tres_per_node="gres:mps:a:20,gres:mps:b:20"), OK, ""),
    ("gpus-per-node-and-per-job", dict(WRAPPER_PACK, min_nodes=4, tres_per_job="gres:gpu:2"), INVALID_GRES,
     "8 GPUs in all is outside 1..6"),
    ("count-too-long", dict(WRAPPER_PACK, tres_per_node="gres:gpu:9999999999"), INVALID_GRES, "cannot read"),
    # Admitted, so the prolog must fence it (test_prolog_caps_every_value in test_admin_scripts.py).
    ("marker-empty-items-and-zeros", dict(WRAPPER_MPS, comment="slurm-dlrm:mode=no-pack,,gpu_mem_mib=03000,"), OK, ""),
]


def test_submit_rules(tmp_path):
    cases = [(name, dict(desc), None, USER_UID) for name, desc, _, _ in SUBMIT_CASES]
    results = run_cases(tmp_path, cases)
    for name, _, rc, text in SUBMIT_CASES:
        got_rc, msg = results[name]
        assert got_rc == rc, (name, got_rc, msg)
        assert text in msg, (name, msg)
        if rc != OK:
            assert "slurm-dlrm submit" in msg, name  # says how to submit


def test_plain_job_hears_every_problem_at_once(tmp_path):
    rc, msg = run_cases(tmp_path, [("plain", {"partition": "dlrm"}, None, USER_UID)])["plain"]
    assert rc == ACCESS_DENIED
    assert "no slurm-dlrm marker" in msg and "no memory request" in msg and "no GPU request" in msg


def test_root_and_slurm_user_pass(tmp_path):
    plain = {"partition": "dlrm"}
    results = run_cases(tmp_path, [("root", plain, None, 0), ("slurmsvc", plain, None, SLURM_UID),
                                   ("user", plain, None, USER_UID)])
    assert results["root"][0] == OK and results["slurmsvc"][0] == OK
    assert results["user"][0] == ACCESS_DENIED


def test_not_enforced_when_the_site_says_so(tmp_path):
    raw = site_raw()
    raw["partitions"][0]["enforce"] = False
    assert run_cases(tmp_path, [("plain", {"partition": "dlrm"}, None, USER_UID)], raw)["plain"][0] == OK


def test_mps_refused_where_the_site_has_none(tmp_path):
    raw = site_raw()
    raw["mps"]["enabled"] = False
    results = run_cases(tmp_path, [("mps", dict(WRAPPER_MPS), None, USER_UID),
                                   ("gpu", dict(WRAPPER_MPS, tres_per_node="gres:gpu:1"), None, USER_UID)], raw)
    assert results["mps"][0] == INVALID_GRES and "does not offer gres/mps" in results["mps"][1]
    assert results["gpu"][0] == OK


# docs/admin.md "What a forged marker gains": one case per claim. A plain sbatch with a
# hand-typed marker, no wrapper, no estimate.
FORGED_PACK = format_marker("pack", pack_id=999999)  # no such pack: job_submit.lua cannot know
FORGED_CLAIMS = [
    # gains: admission to the DLRM partition, sized as the user likes within the bounds
    ("gains-admission-as-a-pack", {"partition": "dlrm", "comment": FORGED_PACK, "min_mem_per_node": 1024,
                                   "tres_per_node": "gres:gpu:4"}, OK, ""),
    # gains: a --no-pack fence of its own choosing, up to the GPU's memory (the prolog applies it)
    ("gains-its-own-fence", dict(WRAPPER_MPS, comment=format_marker("no-pack", gpu_mem_mib=81920)), OK, ""),
    # does not gain: leaving out the memory request
    ("not-without-memory", {"partition": "dlrm", "comment": FORGED_PACK, "tres_per_node": "gres:gpu:1"},
     MISSING_SIZE, "no memory request"),
    # does not gain: more GPUs than the partition's bounds
    ("not-more-gpus", {"partition": "dlrm", "comment": FORGED_PACK, "min_mem_per_node": 1024,
                       "tres_per_job": "gres:gpu:7"}, INVALID_GRES, "outside 1..6"),
    # does not gain: an MPS share outside min_mps_share..mps_per_gpu
    ("not-a-bigger-share", dict(WRAPPER_MPS, tres_per_node="gres:mps:200"), INVALID_GRES, "outside 10..100"),
    # does not gain: a fence beyond the partition's GPU memory
    ("not-a-fence-beyond-the-gpu", dict(WRAPPER_MPS, comment=format_marker("no-pack", gpu_mem_mib=81921)),
     ACCESS_DENIED, "exceeds the 81920 MiB"),
    # does not gain: an unfenced MPS job (the prolog fences only mode=no-pack)
    ("not-an-unfenced-mps-share", dict(WRAPPER_MPS, comment=FORGED_PACK), INVALID_GRES, "not --gres=mps:N"),
]


def test_what_a_forged_marker_gains_and_does_not(tmp_path):
    results = run_cases(tmp_path, [(name, dict(desc), None, USER_UID) for name, desc, _, _ in FORGED_CLAIMS])
    for name, _, rc, text in FORGED_CLAIMS:
        assert results[name][0] == rc, (name, results[name])
        assert text in results[name][1], (name, results[name])
    # The header no longer claims what does not hold.
    script = {f.name: f.text for f in render_site(parse_site(site_raw()))}["job_submit.lua"]
    assert "cannot be bypassed" not in script and "any user can type it" in script


# The job record of an accepted wrapper job, as slurm_job_modify sees it.
RECORD = dict(WRAPPER_MPS, min_nodes=1)
PLAIN_RECORD = {"partition": "debug", "min_nodes": 1}
MODIFY_CASES = [
    ("time-limit-only", {}, RECORD, OK, ""),
    ("comment-replaced", {"comment": "hello"}, RECORD, ACCESS_DENIED, "no slurm-dlrm marker"),
    ("comment-cleared", {"comment": ""}, RECORD, ACCESS_DENIED, "no slurm-dlrm marker"),
    ("mps-within", {"tres_per_node": "gres:mps:70"}, RECORD, OK, ""),
    ("mps-beyond", {"tres_per_node": "gres:mps:300"}, RECORD, INVALID_GRES, "outside 10..100"),
    ("gres-cleared", {"tres_per_node": ""}, RECORD, INVALID_GRES, "no GPU request"),
    ("memory-raised", {"min_mem_per_node": 9000}, RECORD, OK, ""),
    ("move-plain-job-in", {"partition": "dlrm"}, PLAIN_RECORD, ACCESS_DENIED, "no slurm-dlrm marker"),
    ("plain-job-elsewhere", {"comment": "x"}, PLAIN_RECORD, OK, ""),
]


def test_modify_rules(tmp_path):
    results = run_cases(tmp_path, [(n, d, r, USER_UID) for n, d, r, _, _ in MODIFY_CASES])
    for name, _, _, rc, text in MODIFY_CASES:
        assert results[name][0] == rc, (name, results[name])
        assert text in results[name][1], (name, results[name])


def test_root_may_modify_anything(tmp_path):
    results = run_cases(tmp_path, [("root", {"comment": "hello"}, RECORD, 0)])
    assert results["root"][0] == OK


COMMENTS = [NO_PACK, PACK, NO_PACK + ",x=y", "slurm-dlrm:mode=no-pack", "slurm-dlrm:mode=pack,pack_id=-1",
            "slurm-dlrm:mode=no-pack,gpu_mem_mib=0", "slurm-dlrm:mode=pack,pack_id=3,bad", "slurm-dlrm:",
            "other comment", "slurm-dlrm:mode=no-pack,gpu_mem_mib=12a", "slurm-dlrm:mode=pack,pack_id=1,x=$(id)"]


def test_python_and_lua_agree_on_markers(tmp_path):
    """The wrapper writes markers with format_marker; job_submit.lua must read them alike."""
    cases = [(f"c{i}", dict(WRAPPER_PACK, comment=c), None, USER_UID) for i, c in enumerate(COMMENTS)]
    results = run_cases(tmp_path, cases)
    for i, comment in enumerate(COMMENTS):
        try:
            python_ok = parse_marker(comment) is not None
        except BadInput:
            python_ok = False
        lua_ok = results[f"c{i}"][0] == OK
        assert python_ok == lua_ok, comment


def test_format_marker_round_trip():
    m = parse_marker(format_marker("no-pack", gpu_mem_mib=3000, job_id=5))
    assert m is not None and (m.mode, m.gpu_mem_mib, m.job_id) == ("no-pack", 3000, 5)
    with pytest.raises(BadInput):
        format_marker("no-pack")
    packed = format_marker("pack", pack_id=7, extra={"pack": "alice-pack-7"})
    assert packed == "slurm-dlrm:mode=pack,pack_id=7,pack=alice-pack-7"
    m = parse_marker(packed)
    assert m is not None and m.pack_id == 7 and m.extra == (("pack", "alice-pack-7"),)
    for bad in ({"pack": "a b"}, {"mode": "x"}, {"Pack": "x"}):
        with pytest.raises(BadInput):
            format_marker("pack", pack_id=1, extra=bad)
    assert parse_marker("not ours") is None


@settings(max_examples=1, deadline=None)
@given(st.lists(st.text(min_size=0, max_size=40), min_size=30, max_size=30))
def test_lua_string_literals_survive_any_text(tmp_path_factory, texts):
    """Whatever a site puts in a value, Lua reads back the same bytes."""
    tmp = tmp_path_factory.mktemp("lua")
    script = tmp / "echo.lua"
    script.write_text("".join(f"io.write({lua_str(t)}, '\\0')\n" for t in texts))
    proc = subprocess.run([LUA, str(script)], capture_output=True, timeout=30)  # noqa: S603
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split(b"\0")[:-1] == [t.encode() for t in texts]


# A site's own job_submit.lua (its own rule: no job named "forbidden"), chained to the
# module as docs/admin.md "Installs that chain" shows.
SITE_SCRIPT = """
slurm_dlrm = dofile(MODULE)  -- global only so the harness can point passwd_file elsewhere
local function site_rules(job_desc)
  if job_desc.name == "forbidden" then
    slurm.log_user("site: no job may be called forbidden")
    return slurm.ERROR
  end
  return slurm.SUCCESS
end
function slurm_job_submit(job_desc, part_list, submit_uid)
  local rc = slurm_dlrm.job_submit(job_desc, part_list, submit_uid)
  if rc ~= slurm.SUCCESS then return rc end
  return site_rules(job_desc)
end
function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  local rc = slurm_dlrm.job_modify(job_desc, job_rec, part_list, modify_uid)
  if rc ~= slurm.SUCCESS then return rc end
  return site_rules(job_desc)
end
return slurm.SUCCESS
"""


def test_the_module_called_from_a_site_script_checks_as_the_standalone_one(tmp_path):
    cases = [(name, desc, None, USER_UID) for name, desc, _, _ in SUBMIT_CASES]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    standalone = run_cases(tmp_path / "a", cases)
    chained = run_cases(tmp_path / "b", cases, site_script=SITE_SCRIPT)
    assert chained == standalone
    # The site's own rule still holds, in its partitions and in ours, after our checks.
    site_only = run_cases(tmp_path / "b", [
        ("site-rule-other-partition", {"partition": "debug", "name": "forbidden"}, None, USER_UID),
        ("site-rule-dlrm", dict(WRAPPER_MPS, name="forbidden"), None, USER_UID),
        ("ours-first", {"partition": "dlrm", "name": "forbidden"}, None, USER_UID),
        ("modify", {"partition": "debug", "name": "forbidden"}, {"partition": "debug"}, USER_UID)],
        site_script=SITE_SCRIPT)
    assert site_only["site-rule-other-partition"] == (-1, "site: no job may be called forbidden")
    assert site_only["site-rule-dlrm"] == (-1, "site: no job may be called forbidden")
    assert site_only["ours-first"][0] == ACCESS_DENIED and "no slurm-dlrm marker" in site_only["ours-first"][1]
    assert site_only["modify"][0] == -1


def test_the_module_defines_no_global_and_registers_nothing(tmp_path):
    files = {f.name: f.text for f in render_site(parse_site(site_raw()))}
    module = tmp_path / "m.lua"
    module.write_text(files["slurm_dlrm_submit.lua"])
    driver = tmp_path / "d.lua"
    driver.write_text("slurm = {SUCCESS = 0}\nlocal before = {}\nfor k in pairs(_G) do before[k] = true end\n"
                      f"local m = dofile({lua_str(module)})\n"
                      "for k in pairs(_G) do if not before[k] then io.write('global ', k, '\\n') end end\n"
                      "io.write(type(m.job_submit), ' ', type(m.job_modify), '\\n')\n")
    proc = subprocess.run([LUA, str(driver)], capture_output=True, text=True, timeout=30)  # noqa: S603
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "function function\n"


def shared_after(tmp_path: Path, cross_user: str, cases: list[tuple[str, dict, dict | None, int]]) -> dict[str, str]:
    """job_desc.shared after the rendered script ran each case (nil: left alone)."""
    raw = site_raw()
    raw["mps"]["cross_user"] = cross_user
    files = {f.name: f.text for f in render_site(parse_site(raw))}
    script = tmp_path / f"job_submit-{cross_user}.lua"
    script.write_text(files["job_submit.lua"])
    lines = ["slurm = {SUCCESS = 0, ERROR = -1, JOB_SHARED_USER = 2, ESLURM_ACCESS_DENIED = 2002,",
             "  log_user = function() end, log_info = function() end}",
             f"dofile({lua_str(script)})", f"slurm_dlrm.passwd_file = {lua_str(tmp_path / 'none')}"]
    for name, desc, rec, uid in cases:
        call = (f"slurm_job_submit(d, {{}}, {uid})" if rec is None
                else f"slurm_job_modify(d, {to_lua(rec)}, {{}}, {uid})")
        lines.append(f"do local d = {to_lua(desc)}; d.min_nodes = d.min_nodes or {NO_VAL}; local rc = {call}; "
                     f"io.write({lua_str(name)}, ' ', tostring(rc), ' ', tostring(d.shared), '\\n') end")
    driver = tmp_path / f"shared-{cross_user}.lua"
    driver.write_text("\n".join(lines) + "\n")
    proc = subprocess.run([LUA, str(driver)], capture_output=True, text=True, timeout=30)  # noqa: S603
    assert proc.returncode == 0, proc.stderr
    return {line.split()[0]: " ".join(line.split()[1:]) for line in proc.stdout.splitlines()}


CROSS_USER_CASES = [
    ("mps", WRAPPER_MPS, None, USER_UID),
    ("mps-root", {"partition": "dlrm", "tres_per_node": "gres:mps:40"}, None, 0),
    ("pack", WRAPPER_PACK, None, USER_UID),
    ("mps-other-partition", {"partition": "debug", "tres_per_node": "gres:mps:40"}, None, USER_UID),
    ("refused", {"partition": "dlrm", "tres_per_node": "gres:mps:40"}, None, USER_UID),
    # `scontrol update OverSubscribe=YES` (shared=1) on a pending MPS job: set back.
    ("modify-oversubscribe", {"shared": 1}, dict(WRAPPER_MPS), USER_UID),
    # Any other update (unset shared arrives as NO_VAL16) leaves it alone.
    ("modify-other", {"shared": 65534, "tres_per_node": "gres:mps:60"}, dict(WRAPPER_MPS), USER_UID),
]


def test_one_user_per_gpu_gives_mps_jobs_exclusive_user(tmp_path):
    """[mps] cross_user = "one-user": every gres/mps job of a DLRM partition (root's too,
    and an update that tries to loosen it) gets --exclusive=user (shared = JOB_SHARED_USER); whole-GPU packs and
    other partitions are left alone, and a refused job is not touched."""
    got = shared_after(tmp_path, "one-user", CROSS_USER_CASES)
    assert got == {"mps": "0 2", "mps-root": "0 2", "pack": "0 nil", "mps-other-partition": "0 nil",
                   "refused": f"{ACCESS_DENIED} nil", "modify-oversubscribe": "0 2",
                   "modify-other": "0 65534"}
    # "time-slice" (the default) leaves every job as submitted.
    plain = shared_after(tmp_path, "time-slice", CROSS_USER_CASES)
    assert plain == {"mps": "0 nil", "mps-root": "0 nil", "pack": "0 nil", "mps-other-partition": "0 nil",
                     "refused": f"{ACCESS_DENIED} nil", "modify-oversubscribe": "0 1",
                     "modify-other": "0 65534"}


def test_harness_keeps_a_carriage_return_in_a_message(tmp_path):
    """The comment is echoed in the refusal; a \\r in it must not split the harness's record
    (text=True's universal newlines did: the adversarial suite failed on such a comment)."""
    if LUA is None:
        pytest.skip("lua5.1 not installed (scripts/setup.sh installs it)")
    desc = {"partition": "dlrm", "comment": "slurm-dlrm:mode=no-pack,gpu_mem_mib=3000\rX",
            "min_mem_per_node": 4096, "tres_per_node": "gres:mps:40"}
    rc, msg = run_cases(tmp_path, [("cr", desc, None, USER_UID)], site_raw())["cr"]
    assert rc != OK and "'gpu_mem_mib=3000\rX'" in msg
