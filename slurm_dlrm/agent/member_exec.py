"""Run as the command of a member's Slurm job step: become a process group leader,
set the member's environment, write our pid for the agent, then exec the member.

    python -m slurm_dlrm.agent.member_exec --pid-file P [--setenv K=V ...] -- CMD ARGS...

Slurm sets CUDA_VISIBLE_DEVICES (and, under gres/mps, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)
for every step itself, so the member's own values are applied here, after slurmstepd.
The pid lets the agent sample and signal the member's process group directly, the same
way as for a member it started as a child.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    pid_file = None
    env: dict[str, str] = {}
    i = 0
    while i < len(argv) and argv[i] != "--":
        if argv[i] == "--pid-file" and i + 1 < len(argv):
            pid_file = argv[i + 1]
        elif argv[i] == "--setenv" and i + 1 < len(argv) and "=" in argv[i + 1]:
            key, _, value = argv[i + 1].partition("=")
            env[key] = value
        else:
            print(f"member_exec: bad argument {argv[i]!r}", file=sys.stderr)
            return 2
        i += 2
    command = argv[i + 1:]
    if not command:
        print("member_exec: no command after --", file=sys.stderr)
        return 2
    try:
        os.setsid()
    except PermissionError:  # already a process group leader (slurmstepd made us one)
        pass
    os.environ.update(env)
    if pid_file:
        tmp = f"{pid_file}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{os.getpid()}\n")
        os.replace(tmp, pid_file)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"member_exec: cannot run {command[0]}: {exc}", file=sys.stderr)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
