"""Named SQL queries of the store, in one place so they can be read, reviewed and tested.

Run with `Store.query(name, params)`. Optional filters are written as
``(:x IS NULL OR ...)``; lists are passed as a JSON array and unpacked with
`json_each`, so each query is one static statement.
"""

from __future__ import annotations

from slurm_dlrm.store.states import JOB_TERMINAL

UPSERT_JOB_USAGE = """
INSERT INTO job_usage (job_id, n_samples, gpu_mem_peak_bytes, rss_peak_bytes, sm_util_sum, sm_util_n,
                       sm_util_max, host_cpu_sum, host_cpu_n, sps_sum, sps_n, first_t, last_t)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT(job_id) DO UPDATE SET
    n_samples = n_samples + excluded.n_samples,
    -- SQLite's max(NULL, x) is NULL, hence the coalesce pairs
    gpu_mem_peak_bytes = max(coalesce(gpu_mem_peak_bytes, excluded.gpu_mem_peak_bytes),
                             coalesce(excluded.gpu_mem_peak_bytes, gpu_mem_peak_bytes)),
    rss_peak_bytes = max(coalesce(rss_peak_bytes, excluded.rss_peak_bytes),
                         coalesce(excluded.rss_peak_bytes, rss_peak_bytes)),
    sm_util_sum = sm_util_sum + excluded.sm_util_sum,
    sm_util_n = sm_util_n + excluded.sm_util_n,
    sm_util_max = max(coalesce(sm_util_max, excluded.sm_util_max), coalesce(excluded.sm_util_max, sm_util_max)),
    host_cpu_sum = host_cpu_sum + excluded.host_cpu_sum,
    host_cpu_n = host_cpu_n + excluded.host_cpu_n,
    sps_sum = sps_sum + excluded.sps_sum,
    sps_n = sps_n + excluded.sps_n,
    first_t = min(coalesce(first_t, excluded.first_t), coalesce(excluded.first_t, first_t)),
    last_t = max(coalesce(last_t, excluded.last_t), coalesce(excluded.last_t, last_t))
"""

# GPU-hours (docs/store.md, "GPU-hours"): every GPU a pack's member ran on is charged
# for the pack's allocated time on it; that time is split among the GPU's members in
# proportion to how long each ran there.
ACCT = """
WITH last_end AS (
    -- when the pack's last member ended (NULL while one runs): the agents then wait
    -- join_grace_s for joiners; that tail is the service's bet on refill, not a member's
    -- use, so it is not charged (issue 42: a 5 s job was charged 18 s of it)
    SELECT pack_id, CASE WHEN count(*) = count(end_time) THEN max(end_time) END AS t
    FROM placements WHERE start_time IS NOT NULL GROUP BY pack_id
),
gpu AS (
    -- every GPU of a pack that had a running member: members' seconds and allocated seconds
    SELECT p.pack_id, p.node_index, p.gpu_index, count(*) AS n_members,
           sum(max(0.0, coalesce(p.end_time, :now) - p.start_time)) AS member_s,
           max(0.0, min(coalesce(k.end_time, :now), coalesce(le.t, k.end_time, :now))
                    - coalesce(k.start_time, min(p.start_time))) AS alloc_s
    FROM placements p JOIN packs k ON k.id = p.pack_id LEFT JOIN last_end le ON le.pack_id = p.pack_id
    WHERE p.start_time IS NOT NULL
    GROUP BY p.pack_id, p.node_index, p.gpu_index
),
charge AS (
    SELECT p.job_id,
           sum(CASE WHEN g.member_s > 0
                    THEN g.alloc_s * max(0.0, coalesce(p.end_time, :now) - p.start_time) / g.member_s
                    ELSE g.alloc_s / g.n_members END) AS charged_gpu_s,
           sum(max(0.0, coalesce(p.end_time, :now) - p.start_time)) AS gpu_run_s,
           -- the same run time, shortened on a shared GPU to what the member would have
           -- needed alone at the relative speed the packing plan predicted for it
           sum(max(0.0, coalesce(p.end_time, :now) - p.start_time)
               * CASE WHEN g.n_members > 1 THEN min(1.0, max(0.0, coalesce(p.predicted_speed, 1.0)))
                      ELSE 1.0 END) AS excl_pred_s,
           max(CASE WHEN g.n_members > 1 AND p.predicted_speed IS NOT NULL THEN 1 ELSE 0 END) AS has_pred,
           max(g.n_members) AS max_members
    FROM placements p
    JOIN gpu g ON g.pack_id = p.pack_id AND g.node_index = p.node_index AND g.gpu_index = p.gpu_index
    WHERE p.start_time IS NOT NULL
    GROUP BY p.job_id
),
-- per job and pack: GPUs, and how long the member ran there
jp AS (
    SELECT job_id, pack_id, count(*) AS n_gpus,
           max(coalesce(end_time, :now)) - min(start_time) AS run_s
    FROM placements GROUP BY job_id, pack_id
),
span AS (
    SELECT job_id, sum(run_s) AS run_s FROM jp GROUP BY job_id
),
-- measured solo throughput per spec fingerprint and GPU model: jobs that never shared a
-- GPU. Only such a figure (same structure, same device) makes a measured slowdown.
-- held-out evaluations (issue 39): the last one and the best AUC / NE with their steps
-- (SQLite's bare columns take the row of the max/min)
ev_final AS (
    SELECT job_id, max(step) AS final_eval_step, auc AS final_auc, ne AS final_ne, log_loss AS final_log_loss,
           calibration AS final_calibration, accuracy AS final_accuracy, count(*) AS n_evals
    FROM evals GROUP BY job_id
),
ev_auc AS (SELECT job_id, max(auc) AS best_auc, step AS best_auc_step FROM evals WHERE auc IS NOT NULL GROUP BY job_id),
ev_ne AS (SELECT job_id, min(ne) AS best_ne, step AS best_ne_step FROM evals WHERE ne IS NOT NULL GROUP BY job_id),
ev_planted AS (SELECT job_id, max(planted_auc) AS planted_auc FROM evals GROUP BY job_id),
-- a multi-rank run's measured peaks per rank (issue 48), as JSON arrays in rank order
rp AS (
    SELECT job_id, json_group_array(gpu_mem_peak_bytes) AS rank_gpu_mem_peaks,
           json_group_array(rss_peak_bytes) AS rank_rss_peaks, json_group_array(tensor_peak_bytes) AS rank_tensor_peaks,
           max(gpu_mem_peak_bytes) AS rank_gpu_mem_max, max(rss_peak_bytes) AS rank_rss_max
    FROM (SELECT * FROM rank_peaks ORDER BY job_id, rank) GROUP BY job_id
),
solo AS (
    SELECT j.spec_fingerprint, k.gpu_model, sum(u.sps_sum) / sum(u.sps_n) AS solo_sps
    FROM jobs j JOIN charge c ON c.job_id = j.id JOIN job_usage u ON u.job_id = j.id
    JOIN packs k ON k.id = j.pack_id
    WHERE c.max_members = 1 AND u.sps_n > 0
    GROUP BY j.spec_fingerprint, k.gpu_model
)
-- the derived columns, so that every output format (and the SQL-formatted table) agrees
SELECT x.*, x.excl_gpu_hours - x.gpu_hours AS gpu_hours_saved FROM (
SELECT b.*,
       CASE WHEN b.start_time IS NOT NULL THEN b.start_time - b.submit_time
            WHEN b.state IN ({TERMINAL}) AND b.end_time IS NOT NULL THEN b.end_time - b.submit_time
            ELSE :now - b.submit_time END AS wait_s,
       coalesce(b.span_s, 0.0) AS run_s,
       coalesce(b.job_slurm_job_id, b.pack_slurm_job_id || coalesce('.' || b.slurm_step, '')) AS slurm_job_id,
       coalesce(b.charged_gpu_s, 0.0) / 3600.0 AS gpu_hours,
       -- slowdown correction, only for jobs that shared a GPU (docs/store.md, GPU-hours):
       -- measured against solo runs of the same spec on the same GPU model, else the
       -- plan's predicted speed, else none
       CASE WHEN b.max_members > 1 AND b.solo_sps > 0 AND b.samples_per_s_mean > 0
            THEN coalesce(b.gpu_run_s, 0.0) * min(1.0, b.samples_per_s_mean / b.solo_sps)
            ELSE coalesce(b.excl_pred_s, 0.0) END / 3600.0 AS excl_gpu_hours,
       CASE WHEN b.max_members IS NULL THEN NULL WHEN b.max_members = 1 THEN 'solo'
            WHEN b.solo_sps > 0 AND b.samples_per_s_mean > 0 THEN 'measured'
            WHEN b.has_pred THEN 'predicted' ELSE 'none' END AS speed_basis
FROM (
SELECT j.id AS job_id, j.user, j.name, j.state, j.attempt, j.spec_fingerprint, j.gpu_model,
       j.est_gpu_peak_bytes, j.est_host_peak_bytes, j.est_profile_label, j.est_solo_samples_per_s,
       j.submit_time, j.start_time, j.end_time, j.pack_id, j.slurm_job_id AS job_slurm_job_id, j.slurm_step,
       j.exit_code, j.exit_reason,
       -- sacct's Partition and Account (issue 42): the job's own -p/-A, else its pack's partition
       coalesce((SELECT json_extract(js.sbatch_json, '$.partition') FROM job_specs js WHERE js.job_id = j.id),
                k.partition) AS partition,
       j.array_task_id,
       (SELECT json_extract(js.sbatch_json, '$.account') FROM job_specs js WHERE js.job_id = j.id) AS account,
       CASE WHEN j.array_job_id IS NULL THEN CAST(j.id AS TEXT)
            ELSE j.array_job_id || '_' || j.array_task_id END AS array_id,
       CASE WHEN j.mode = 'no-pack' THEN 'no-pack' ELSE k.name END AS pack_name,
       k.slurm_job_id AS pack_slurm_job_id,
       CASE WHEN j.mode = 'no-pack' THEN CAST(max(1.0, coalesce(j.gpu_share, 1.0)) AS INTEGER)
            ELSE coalesce(last.n_gpus, 0) END AS n_gpus,
       CASE WHEN j.mode = 'no-pack' THEN j.nodes ELSE k.nodes END AS nodes,
       -- sampled by a pack's agent; else (a job of its own Slurm job) the runner's ranks' highest
       coalesce(u.n_samples, 0) AS n_samples, coalesce(u.gpu_mem_peak_bytes, rp.rank_gpu_mem_max) AS gpu_mem_peak_bytes,
       coalesce(u.rss_peak_bytes, rp.rank_rss_max) AS rss_peak_bytes,
       rp.rank_gpu_mem_peaks, rp.rank_rss_peaks, rp.rank_tensor_peaks,
       CASE WHEN u.sm_util_n > 0 THEN u.sm_util_sum / u.sm_util_n END AS sm_util_mean,
       u.sm_util_max,
       CASE WHEN u.host_cpu_n > 0 THEN u.host_cpu_sum / u.host_cpu_n END AS host_cpu_mean,
       CASE WHEN u.sps_n > 0 THEN u.sps_sum / u.sps_n END AS samples_per_s_mean,
       coalesce(c.charged_gpu_s, nat.run_s * coalesce(j.gpu_share, 1.0)) AS charged_gpu_s,
       coalesce(c.gpu_run_s, nat.run_s) AS gpu_run_s,
       coalesce(c.excl_pred_s, nat.run_s * CAST(max(1.0, coalesce(j.gpu_share, 1.0)) AS INTEGER)) AS excl_pred_s,
       c.has_pred, coalesce(c.max_members, CASE WHEN nat.run_s IS NOT NULL THEN 1 END) AS max_members,
       coalesce(sp.run_s, nat.run_s) AS span_s,
       so.solo_sps,
       evf.final_eval_step, evf.final_auc, evf.final_ne, evf.final_log_loss, evf.final_calibration,
       evf.final_accuracy, coalesce(evf.n_evals, 0) AS n_evals, eva.best_auc, eva.best_auc_step,
       evn.best_ne, evn.best_ne_step, evp.planted_auc
FROM jobs j
LEFT JOIN packs k ON k.id = j.pack_id
LEFT JOIN job_usage u ON u.job_id = j.id
LEFT JOIN charge c ON c.job_id = j.id
LEFT JOIN jp last ON last.job_id = j.id AND last.pack_id = j.pack_id
LEFT JOIN span sp ON sp.job_id = j.id
-- a `submit --no-pack` job (issue 23): its own Slurm job, charged its GPUs (an MPS share
-- counts as its fraction) for the time it ran; alone, so its basis is 'solo'. One that
-- Slurm requeued: its runs as sacct gives them (slurm_run_s), not the wait between them
LEFT JOIN (SELECT id, coalesce(slurm_run_s, max(0.0, coalesce(end_time, :now) - start_time)) AS run_s FROM jobs
           WHERE mode = 'no-pack' AND start_time IS NOT NULL) nat ON nat.id = j.id
LEFT JOIN solo so ON so.spec_fingerprint = j.spec_fingerprint AND so.gpu_model IS k.gpu_model
LEFT JOIN ev_final evf ON evf.job_id = j.id
LEFT JOIN ev_auc eva ON eva.job_id = j.id
LEFT JOIN ev_ne evn ON evn.job_id = j.id
LEFT JOIN ev_planted evp ON evp.job_id = j.id
LEFT JOIN rp ON rp.job_id = j.id
WHERE (:job_ids IS NULL OR j.id IN (SELECT value FROM json_each(:job_ids)))
  AND (:states IS NULL OR j.state IN (SELECT value FROM json_each(:states)))
  AND (:users IS NULL OR j.user IN (SELECT value FROM json_each(:users)))
  AND (:pack_id IS NULL OR j.id IN (SELECT job_id FROM placements WHERE pack_id = :pack_id))
  AND (:since IS NULL OR coalesce(j.end_time, 1e300) >= :since)
  AND (:until IS NULL OR j.submit_time <= :until)
) b) x
ORDER BY x.job_id
""".replace("{TERMINAL}", ", ".join(f"'{s.value}'" for s in sorted(JOB_TERMINAL)))

# acct's rows with sacct's --name (a task of an array submitted with -J NAME is named
# NAME-<task>: NAME finds it, as Slurm names all tasks alike) and Partition's default
# (a job given no -p that never ran in a pack is in the site's default partition)
ACCT_FILTERED = (
    "SELECT a.*, coalesce(a.partition, :default_partition) AS partition_or_default FROM (" + ACCT + ") a "
    "WHERE (:names IS NULL OR a.name IN (SELECT value FROM json_each(:names)) "
    "OR (a.array_task_id IS NOT NULL AND a.name IN (SELECT value || '-' || a.array_task_id FROM json_each(:names))))"
)

CALIBRATION = """
SELECT j.id AS job_id, j.state, j.end_time,
       j.est_gpu_peak_bytes, u.gpu_mem_peak_bytes AS meas_gpu_peak_bytes,
       j.est_host_peak_bytes, u.rss_peak_bytes AS meas_host_peak_bytes,
       coalesce(u.n_samples, 0) AS n_samples
FROM jobs j LEFT JOIN job_usage u ON u.job_id = j.id
WHERE j.spec_fingerprint = :fingerprint
  AND j.state IN (SELECT value FROM json_each(:terminal))
ORDER BY j.end_time DESC, j.id DESC
LIMIT :limit
"""

# The site-wide host calibration (estimate/calibrate.py `site_calibrate`): the most
# recent COMPLETED jobs of any fingerprint with a measured peak RSS, of one device kind
# as the estimate's host breakdown tells it (`estimate_device_kind`: a `runtime` term,
# and `tensors` only for a CPU run), with the estimate they were submitted with and their
# last pack's folder (where the runner's metrics say which device it trained on).
SITE_HOST_RUNS = """
SELECT j.id AS job_id, coalesce(j.end_time, j.updated_time) AS end_time, s.estimate_json,
       u.rss_peak_bytes AS meas_host_peak_bytes, (SELECT p.pack_dir FROM packs p WHERE p.id = j.pack_id) AS pack_dir
FROM jobs j JOIN job_usage u ON u.job_id = j.id JOIN job_specs s ON s.job_id = j.id
WHERE j.state = :completed AND u.rss_peak_bytes > 0 AND s.estimate_json IS NOT NULL
  AND json_type(s.estimate_json, '$.host_breakdown.runtime') IS NOT NULL
  AND (CASE WHEN json_type(s.estimate_json, '$.host_breakdown.tensors') IS NOT NULL THEN 'cpu' ELSE 'cuda' END)
      = :device_kind
ORDER BY end_time DESC, j.id DESC
LIMIT :limit
"""

# Live members' measured GPU peaks in one pack (NVML's per-process bytes, the CUDA
# context included), per rank GPU, with the span their samples cover: refill counts a
# member past its warm-up at its peak (service/measured.py). The job index serves it.
MEMBER_PEAKS = """
SELECT job_id, gpu_index, MAX(gpu_mem_bytes) AS gpu_mem_peak_bytes, MIN(t) AS first_t, MAX(t) AS last_t
FROM samples
WHERE job_id IN (SELECT value FROM json_each(:job_ids)) AND pack_id = :pack_id AND gpu_mem_bytes IS NOT NULL
GROUP BY job_id, gpu_index
"""

# A user's most recent measured jobs: estimate vs measured GPU peak, for the margin
# learned from the estimate's error (service/measured.py, adapt/margin.py).
PEAK_ERRORS = """
SELECT j.id AS job_id, s.estimate_json, j.gpu_model, u.gpu_mem_peak_bytes, u.first_t, u.last_t
FROM jobs j JOIN job_usage u ON u.job_id = j.id JOIN job_specs s ON s.job_id = j.id
WHERE j.user = :user AND u.gpu_mem_peak_bytes IS NOT NULL
ORDER BY j.id DESC
LIMIT :limit
"""

USAGE_MISMATCH = """
SELECT job_id, n_usage, n_samples FROM (
    SELECT u.job_id, u.n_samples AS n_usage,
           (SELECT count(*) FROM samples s WHERE s.job_id = u.job_id) + u.n_pruned AS n_samples
    FROM job_usage u
) WHERE n_usage != n_samples
UNION ALL
SELECT s.job_id, 0 AS n_usage, count(*) AS n_samples
FROM samples s LEFT JOIN job_usage u ON u.job_id = s.job_id
WHERE s.job_id IS NOT NULL AND u.job_id IS NULL GROUP BY s.job_id
"""

# Report: per-GPU utilisation, averaged into time buckets so a plot stays readable.
GPU_TIMELINE = """
SELECT pack_id, node, gpu_index, job_id,
       CAST(t / :bucket_s AS INTEGER) * :bucket_s AS t,
       avg(sm_util_pct) AS sm_util_pct, max(gpu_mem_bytes) AS gpu_mem_bytes
FROM samples
WHERE t >= :since AND t <= :until AND gpu_index IS NOT NULL
GROUP BY pack_id, node, gpu_index, job_id, CAST(t / :bucket_s AS INTEGER)
ORDER BY pack_id, node, gpu_index, job_id, t
"""

SAMPLE_SPAN = "SELECT min(t) AS t0, max(t) AS t1, count(*) AS n FROM samples WHERE t >= :since AND t <= :until"

GANTT = """
SELECT k.id AS pack_id, k.name AS pack_name, k.state AS pack_state, k.start_time AS pack_start,
       k.end_time AS pack_end, p.job_id, j.name AS job_name, j.state AS job_state,
       min(p.start_time) AS start_time, max(coalesce(p.end_time, :now)) AS end_time,
       count(*) AS n_gpus
FROM packs k JOIN placements p ON p.pack_id = k.id JOIN jobs j ON j.id = p.job_id
WHERE k.start_time IS NOT NULL AND coalesce(k.end_time, :now) >= :since AND k.start_time <= :until
  AND p.start_time IS NOT NULL
GROUP BY k.id, p.job_id
ORDER BY k.start_time, k.id, min(p.start_time)
"""

# `acct --totals` / `--all-users`: ACCT's rows summed per user and partition (a job's
# partition: its current pack's, else the one its sbatch options name).
ACCT_TOTALS = (
    "SELECT a.user, coalesce(k.partition, (SELECT json_extract(s.sbatch_json, '$.partition') "
    "FROM job_specs s WHERE s.job_id = a.job_id)) AS partition, count(*) AS jobs, "
    "sum(a.state IN ('PENDING', 'PLANNED')) AS pending, sum(a.state = 'RUNNING') AS running, "
    "sum(a.state = 'COMPLETED') AS completed, sum(a.state = 'FAILED') AS failed, sum(a.state = 'OOM') AS oom, "
    "sum(a.state = 'CANCELLED') AS cancelled, sum(a.gpu_hours) AS gpu_hours, "
    "sum(a.excl_gpu_hours) AS excl_gpu_hours, sum(a.gpu_hours_saved) AS gpu_hours_saved "
    "FROM (" + ACCT + ") a LEFT JOIN packs k ON k.id = a.pack_id GROUP BY 1, 2"
)

# ---------------------------------------------------------------- the exporter's reads
# (slurm_dlrm/store/metrics.py; docs/admin.md "Prometheus"). Each one is an indexed
# lookup or a grouping over small tables: a scrape must stay cheap with 1,000 active jobs.

# Jobs per state, of the states in :states (the exporter asks for the active ones every
# scrape, through the jobs_state index, and for the rest at its slow refresh). A job's
# partition and GPU model are those of its current pack; a job never packed takes the
# partition its sbatch options name (looked up for those only).
METRIC_JOBS = """
SELECT j.user, coalesce(k.partition, (SELECT json_extract(s.sbatch_json, '$.partition')
                                      FROM job_specs s WHERE s.job_id = j.id)) AS partition,
       coalesce(k.gpu_model, j.gpu_model) AS gpu_model, j.state, count(*) AS n
FROM jobs j LEFT JOIN packs k ON k.id = j.pack_id
WHERE j.state IN (SELECT value FROM json_each(:states))
GROUP BY 1, 2, 3, 4
"""

METRIC_PACKS = (
    "SELECT user, partition, gpu_model, state, count(*) AS n FROM packs "
    "WHERE state IN (SELECT value FROM json_each(:states)) GROUP BY 1, 2, 3, 4"
)

# Every GPU of a RUNNING pack that has a placement: its running members and their fences.
METRIC_GPUS = """
SELECT k.id AS pack_id, k.user, k.partition, k.gpu_model, k.slurm_job_id, p.node_index,
       coalesce(p.node, '') AS node, p.gpu_index,
       sum(p.start_time IS NOT NULL AND p.end_time IS NULL) AS members,
       sum(CASE WHEN p.start_time IS NOT NULL AND p.end_time IS NULL THEN p.gpu_mem_limit_bytes END)
           AS fenced_bytes
FROM packs k JOIN placements p ON p.pack_id = k.id
WHERE k.state = 'RUNNING'
GROUP BY k.id, p.node_index, p.gpu_index
"""

# The latest GPU-level sample (job_id NULL) of each GPU since :since: a range seek on
# samples_job_t (job_id, t), so it reads only the last window's GPU samples. A bare
# column next to max() comes from the row holding the max (SQLite's documented rule).
METRIC_GPU_LATEST = """
SELECT pack_id, node, gpu_index, max(t) AS t, sm_util_pct, mem_util_pct, gpu_mem_bytes
FROM samples WHERE job_id IS NULL AND t >= :since
GROUP BY pack_id, node, gpu_index
"""

# Lifecycle events after :after_id (the exporter counts them incrementally by id):
# OOMs, requeues (RUNNING/OOM -> PENDING: an attempt more), and which requeues were a
# recovery (an OOM retried, a pack lost or failed) or a move (straggler or re-pack).
METRIC_EVENTS = """
SELECT coalesce(k.user, j.user) AS user, k.partition, coalesce(k.gpu_model, j.gpu_model) AS gpu_model,
       sum(e.to_state = 'OOM') AS ooms,
       sum(e.to_state = 'PENDING') AS requeues,
       sum(e.to_state = 'PENDING' AND e.from_state = 'OOM') AS recovered_oom,
       sum(e.to_state = 'PENDING' AND e.from_state = 'RUNNING' AND e.reason NOT LIKE 'moved:%') AS recovered_pack,
       sum(e.to_state = 'PENDING' AND e.reason LIKE 'moved:%') AS repacks
FROM events e LEFT JOIN packs k ON k.id = e.pack_id LEFT JOIN jobs j ON j.id = e.job_id
WHERE e.id > :after_id AND e.id <= :upto_id AND e.kind = 'job_state'
  AND (e.to_state = 'OOM' OR (e.to_state = 'PENDING' AND e.from_state IN ('RUNNING', 'OOM')))
GROUP BY 1, 2, 3
"""

# GPU-seconds charged and at one job per GPU, per user/partition/GPU model: acct's own
# definition (ACCT), summed, so the counters and `acct` never disagree.
METRIC_GPU_SECONDS = (
    "SELECT a.user, k.partition, coalesce(k.gpu_model, a.gpu_model) AS gpu_model, "
    "sum(a.gpu_hours) * 3600.0 AS charged_s, sum(a.excl_gpu_hours) * 3600.0 AS exclusive_s "
    "FROM (" + ACCT + ") a LEFT JOIN packs k ON k.id = a.pack_id GROUP BY 1, 2, 3"
)

# Per job, for the two histograms: measured / estimated GPU peak of finished jobs, and
# the queue wait (submit to first start) of jobs that started.
METRIC_JOB_FIGURES = """
SELECT j.user, k.partition, coalesce(k.gpu_model, j.gpu_model) AS gpu_model,
       CASE WHEN j.state IN ({TERMINAL}) AND j.est_gpu_peak_bytes > 0 AND u.gpu_mem_peak_bytes IS NOT NULL
            THEN CAST(u.gpu_mem_peak_bytes AS REAL) / j.est_gpu_peak_bytes END AS est_error_ratio,
       CASE WHEN j.start_time IS NOT NULL THEN max(0.0, j.start_time - j.submit_time) END AS wait_s
FROM jobs j LEFT JOIN packs k ON k.id = j.pack_id LEFT JOIN job_usage u ON u.job_id = j.id
WHERE j.start_time IS NOT NULL OR j.state IN ({TERMINAL})
""".replace("{TERMINAL}", ", ".join(f"'{s.value}'" for s in sorted(JOB_TERMINAL)))

# The last held-out evaluation of each RUNNING job (issue 39): the jobs_state index,
# then the evals primary key (job_id, step) for the newest step.
METRIC_JOB_EVALS = """
SELECT j.id AS job_id, j.user, coalesce(k.partition, (SELECT json_extract(s.sbatch_json, '$.partition')
                                                     FROM job_specs s WHERE s.job_id = j.id)) AS partition,
       coalesce(k.gpu_model, j.gpu_model) AS gpu_model, e.step, e.auc, e.ne, e.log_loss, e.calibration,
       e.accuracy
FROM jobs j LEFT JOIN packs k ON k.id = j.pack_id
JOIN evals e ON e.job_id = j.id AND e.step = (SELECT max(step) FROM evals WHERE job_id = j.id)
WHERE j.state = 'RUNNING'
"""

QUERIES: dict[str, str] = {
    "job_by_id": (
        "SELECT j.*, s.spec_json, s.estimate_json, s.sbatch_json FROM jobs j JOIN job_specs s ON s.job_id = j.id "
        "WHERE j.id = :id"
    ),
    "jobs_by_state": (
        "SELECT j.*, s.spec_json, s.estimate_json, s.sbatch_json FROM jobs j JOIN job_specs s ON s.job_id = j.id "
        "WHERE (:states IS NULL OR j.state IN (SELECT value FROM json_each(:states))) "
        "AND (:user IS NULL OR j.user = :user) ORDER BY j.id"
    ),
    # issue 42: an array's tasks (Slurm's `N_M`), and a pack by the Slurm id squeue shows
    "array_tasks": ("SELECT id, array_task_id, state FROM jobs WHERE array_job_id = :array_job_id "
                    "ORDER BY array_task_id"),
    "job_exists": "SELECT id FROM jobs WHERE id = :id",
    "pack_by_slurm_job_id": "SELECT * FROM packs WHERE slurm_job_id = :slurm_job_id ORDER BY id DESC LIMIT 1",
    "pack_by_id": "SELECT * FROM packs WHERE id = :id",
    "pack_by_name": "SELECT * FROM packs WHERE name = :name",
    "packs_by_state": (
        "SELECT * FROM packs WHERE (:states IS NULL OR state IN (SELECT value FROM json_each(:states))) "
        "AND (:user IS NULL OR user = :user) ORDER BY id"
    ),
    "placements": (
        "SELECT * FROM placements WHERE (:pack_id IS NULL OR pack_id = :pack_id) "
        "AND (:job_id IS NULL OR job_id = :job_id) ORDER BY id"
    ),
    "events": (
        "SELECT * FROM events WHERE (:job_id IS NULL OR job_id = :job_id) "
        "AND (:pack_id IS NULL OR pack_id = :pack_id) AND (:kind IS NULL OR kind = :kind) "
        "AND (:since IS NULL OR t >= :since) ORDER BY id"
    ),
    "job_usage": (
        "SELECT job_id, n_samples, gpu_mem_peak_bytes, rss_peak_bytes, "
        "CASE WHEN sm_util_n > 0 THEN sm_util_sum / sm_util_n END AS sm_util_mean, sm_util_max, "
        "CASE WHEN host_cpu_n > 0 THEN host_cpu_sum / host_cpu_n END AS host_cpu_mean, "
        "CASE WHEN sps_n > 0 THEN sps_sum / sps_n END AS samples_per_s_mean, first_t, last_t "
        "FROM job_usage WHERE job_id = :job_id"
    ),
    "acct": ACCT,
    "acct_filtered": ACCT_FILTERED,
    "calibration": CALIBRATION,
    "site_host_runs": SITE_HOST_RUNS,
    "member_peaks": MEMBER_PEAKS,
    "peak_errors": PEAK_ERRORS,
    "usage_mismatch": USAGE_MISMATCH,
    "gpu_timeline": GPU_TIMELINE,
    "sample_span": SAMPLE_SPAN,
    "gantt": GANTT,
    "acct_totals": ACCT_TOTALS,
    "metric_jobs": METRIC_JOBS,
    "metric_packs": METRIC_PACKS,
    "metric_gpus": METRIC_GPUS,
    "metric_gpu_latest": METRIC_GPU_LATEST,
    "metric_events": METRIC_EVENTS,
    "metric_gpu_seconds": METRIC_GPU_SECONDS,
    "metric_job_figures": METRIC_JOB_FIGURES,
    "metric_job_evals": METRIC_JOB_EVALS,
}
