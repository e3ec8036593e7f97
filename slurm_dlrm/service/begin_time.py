"""`submit --begin` / `#SBATCH --begin`: when a job may start, in the forms sbatch takes
(Slurm's parse_time.c): `now+N[seconds|minutes|hours|days|weeks]` (N alone: seconds),
`HH:MM[:SS]` (today, or tomorrow if that time has passed), `YYYY-MM-DD[THH:MM[:SS]]`,
`MM/DD[/YY]`, and the words `today`, `tomorrow`, `midnight`, `noon`, `elevenses` (11:00),
`fika` (15:00), `teatime` (16:00). Local time, as sbatch. A time in the past is allowed
(the job may start at once), but not one more than a year back: that is a typo.

Pure: the current time is an argument.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta

_UNITS = {"": 1, "s": 1, "sec": 1, "secs": 1, "second": 1, "seconds": 1, "m": 60, "min": 60, "mins": 60,
          "minute": 60, "minutes": 60, "h": 3600, "hour": 3600, "hours": 3600, "d": 86400, "day": 86400,
          "days": 86400, "w": 604800, "week": 604800, "weeks": 604800}
_WORDS = {"midnight": (0, 0), "noon": (12, 0), "elevenses": (11, 0), "fika": (15, 0), "teatime": (16, 0)}
MAX_PAST_S = 366 * 86400.0
FORMS = "now+N[minutes|hours|days|weeks], HH:MM[:SS], YYYY-MM-DD[THH:MM[:SS]], MM/DD[/YY], today, tomorrow, noon"


def parse_begin(text: str, now_s: float) -> float:
    """The begin time as epoch seconds; ValueError with the reason if `text` is not one
    of the forms above or lies more than a year in the past."""
    value = text.strip().lower()
    now = datetime.fromtimestamp(now_s)
    when = _parse(value, now)
    if when is None:
        raise ValueError(f"bad time {text!r} (use {FORMS})")
    t = when.timestamp()
    if t < now_s - MAX_PAST_S:
        raise ValueError(f"{text!r} is more than a year in the past ({when:%Y-%m-%d})")
    return t


def _parse(value: str, now: datetime) -> datetime | None:
    m = re.fullmatch(r"now(?:\+(\d+)([a-z]*))?", value)
    if m:
        if m.group(1) is None:
            return now
        unit = _UNITS.get(m.group(2))
        return None if unit is None else now + timedelta(seconds=int(m.group(1)) * unit)
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
    if value == "today":
        return midnight
    if value == "tomorrow":
        return midnight + timedelta(days=1)
    if value in _WORDS:
        h, mi = _WORDS[value]
        return _next_at(now, h, mi, 0)
    m = re.fullmatch(r"(\d{1,2}):(\d{2})(?::(\d{2}))?", value)
    if m:
        h, mi, s = int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)
        return _next_at(now, h, mi, s) if h < 24 and mi < 60 and s < 60 else None
    m = re.fullmatch(r"(\d{4})-(\d{2})-(\d{2})(?:t(\d{2}):(\d{2})(?::(\d{2}))?)?", value)
    if m:
        try:
            return datetime(int(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4) or 0),
                            int(m.group(5) or 0), int(m.group(6) or 0))
        except ValueError:
            return None
    m = re.fullmatch(r"(\d{1,2})/(\d{1,2})(?:/(\d{2}))?", value)
    if m:
        year = 2000 + int(m.group(3)) if m.group(3) else now.year
        try:
            return datetime(year, int(m.group(1)), int(m.group(2)))
        except ValueError:
            return None
    return None


def _next_at(now: datetime, hour: int, minute: int, second: int) -> datetime:
    """Today at that time, or tomorrow if it has passed (sbatch)."""
    t = now.replace(hour=hour, minute=minute, second=second, microsecond=0)
    return t if t >= now else t + timedelta(days=1)
