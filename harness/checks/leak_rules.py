"""soak.leaks's rules and their words (harness/checks/leaks.py judges with them): how long a unit must be
seen before it is judged, how readings are binned before the slope fit, the early fail's figures,
and the definitions and error control its verdict records."""

from __future__ import annotations

from dataclasses import dataclass

from harness.stats.slope import SEGMENTED, THEIL_SEN

MIN_JUDGED_S = 600.0      # a role, worker or harness observed this long has a trend worth judging (10 minutes)
BIN_S = 30.0              # readings are reduced to medians per bin before the fit ...
SHORT_SPAN_BINS = 18      # ... shorter bins (Rules.bin_for) for a unit seen under 18 of them after its warmup
MAX_FIT_POINTS = 720      # ... with wider bins on runs longer than 6 hours (the fit is O(n^2))
MAX_SERIES_POINTS = 300   # per chart series
HOUR_S = 3600.0
# (reading field, threshold key, what it is, unit of the slope)
GROWTH = (("rss_mb", "rss_growth_mb_per_h", "RSS", "MB/h"),
          ("fds", "fds_growth_per_h", "open file descriptors", "fds/h"),
          ("threads", "threads_growth_per_h", "threads", "threads/h"))
DEFINITIONS = {
    "kv_blocks_leaked": "kv_blocks_used of a worker read with nothing in flight after the load drained, minus "
                        "the same read before the run",
    "growth": f"{SEGMENTED} over {BIN_S:g} s medians (shorter, down to 10 s, for a unit seen under "
              f"{SHORT_SPAN_BINS * BIN_S / 60:g} minutes after the warmup) of each process's readings after its first minute, one "
              "slope per hour common to the processes of a role (or of a worker, across its restarts), each "
              "process keeping its own intercept; the medians are taken as independent around the trend (a "
              "cycle longer than a bin, e.g. a slow allocator sawtooth, makes the interval too narrow)",
    "early_fail": "a role or worker observed under 10 minutes fails when its interval's lower bound is above "
                  "early_factor times the limit, from at least early_points medians over at least early_span_s",
    "per_request": "the role's slope per process times its workers, over the run's completed requests per hour "
                   "(every request passes one worker of each role): evidence only",
    "rss_mb": "VmRSS of /proc/PID/status in MB of 2**20 bytes",
    "harness_rss_band": f"the harness's RSS rise over the run after its first minute ({THEIL_SEN} of its "
                        f"{BIN_S:g} s medians times the span), over its first median then; interval scaled alike",
}
ERROR_CONTROL = {"method": f"{SEGMENTED}: 95 % intervals, each bound one-sided 2.5 %", "budget": "outside the run's "
                 "false-fail budget (docs/soak.md, 'Error rate'): no share, no correction for several measurements"}


@dataclass(frozen=True)
class Rules:
    """The growth rules' figures (module docstring); tests of seconds scale them down."""

    warmup_s: float = 60.0
    bin_s: float = BIN_S
    # the shortest bin: a unit seen briefly gets bins down to it, so that it has medians enough for the
    # early fail (a 3-minute soak leaves 2 minutes after the warmup: 4 medians of 30 s, too few for any
    # bound; 12 of 10 s)
    short_bin_s: float = 10.0
    min_judged_s: float = MIN_JUDGED_S
    early_factor: float = 4.0
    early_points: int = 6       # one more than a Theil-Sen interval's fewest (5)
    early_span_s: float = 90.0

    def bin_for(self, span_s: float) -> float:
        """A unit's bin: ``bin_s`` once its readings after the warmup span SHORT_SPAN_BINS bins of it
        (9 minutes by default), shorter under that, never under ``short_bin_s``."""
        return min(self.bin_s, max(self.short_bin_s, span_s / SHORT_SPAN_BINS))
