--[==[
slurm-dlrm's job_submit module for site "variant" (site.toml).
Rendered by `slurm-dlrm admin render`; edit the site file, not this one.
For a site that has its own job_submit.lua: install this file at
/opt/slurm/etc/slurm_dlrm_submit.lua and call it from that script (docs/admin.md
"Installs that chain"):

  local slurm_dlrm = dofile("/opt/slurm/etc/slurm_dlrm_submit.lua")
  function slurm_job_submit(job_desc, part_list, submit_uid)
    local rc = slurm_dlrm.job_submit(job_desc, part_list, submit_uid)
    if rc ~= slurm.SUCCESS then return rc end
    -- ... the site's own checks ...
    return slurm.SUCCESS
  end
  function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
    local rc = slurm_dlrm.job_modify(job_desc, job_rec, part_list, modify_uid)
    if rc ~= slurm.SUCCESS then return rc end
    return slurm.SUCCESS
  end

It defines no global and registers nothing: it returns a table (job_submit, job_modify).
slurmctld re-reads job_submit.lua when that file changes, not this one: `touch` the site's
script (or `scontrol reconfigure`) after installing a new version of this module.

In a DLRM partition ([[partitions]] enforce = true) a job must carry what the slurm-dlrm
wrapper sets (docs/interfaces.md section 6):
  - a memory request: --mem=<MiB>M (not 0), --mem-per-cpu or --mem-per-gpu;
  - an MPS share --gres=mps:N (min_mps_share <= N <= [mps] mps_per_gpu) or a GPU count
    --gres=gpu:N / --gpus=N (at most the node's GPUs, at most max_gpus_per_job in all);
  - the wrapper's marker in --comment: slurm-dlrm:mode=no-pack,gpu_mem_mib=<MiB>,...
    or slurm-dlrm:mode=pack,pack_id=<id>,...
  - a pack marker (mode=pack) with whole GPUs only: the prolog fences no MPS job of a pack.
Otherwise the job is refused with a message (slurm.log_user) saying how to submit and a
specific ESLURM code. Submit and modify share one validate(); root and SlurmUser pass.
The memory and GPU bounds hold for every job (this runs in slurmctld). The marker does
not prove that the wrapper submitted the job: any user can type it into --comment. What a
forged marker gains and does not gain: docs/admin.md "What a forged marker gains".
--]==]
-- The module's table; passwd_file names where SlurmUser's uid is (tests point it elsewhere).
local M = {passwd_file = "/etc/passwd"}

local MARKER_PREFIX = "slurm-dlrm:"
local MODE_NO_PACK = "no-pack"
local MODE_PACK = "pack"
local SUBMIT_HINT = "Submit DLRM jobs with `slurm-dlrm submit SPEC.yaml [sbatch options]` (packed with others) or `slurm-dlrm submit --no-pack SPEC.yaml` (a job of its own)."
-- [slurm] slurm_user: this account (SlurmUser) and root are never refused.
local SLURM_USER = "slurmsvc"
-- [mps] enabled: whether --gres=mps:N is offered at all.
local MPS_ENABLED = false
-- [mps] cross_user = "one-user": every gres/mps job in a DLRM partition gets --exclusive=user
-- (OverSubscribe=USER), since MPS runs one user's jobs on a GPU at a time and jobs of
-- two users on one GPU would take turns. Slurm has no per-GPU form: the node is the unit.
local MPS_ONE_USER = false
-- The partition with default = true, used when a job names none (nil: no default here).
local DEFAULT_PARTITION = "debug"

-- [[partitions]]: enforce; max_gpus_per_job; max_gpus_per_node (GPUs of the partition's
-- largest node); min_mps_share; max_mps_share ([mps] mps_per_gpu, one whole GPU);
-- gpu_mem_mib_max (memory of the partition's smallest GPU model, bounds gpu_mem_mib).
local PARTITIONS = {
  ["dlrm-big"] = {
    enforce = true,
    max_gpus_per_job = 16,
    max_gpus_per_node = 8,
    min_mps_share = 1,
    max_mps_share = 100,
    gpu_mem_mib_max = 40960,
  },
  ["debug"] = {
    enforce = false,
    max_gpus_per_job = 2,
    max_gpus_per_node = 8,
    min_mps_share = 1,
    max_mps_share = 100,
    gpu_mem_mib_max = 24576,
  },
}

-- Slurm 22.05's plugin exposes only some ESLURM_* names; the numbers are slurm_errno.h's.
local ESLURM_FALLBACK = {
  ESLURM_ACCESS_DENIED = 2002,
  ESLURM_JOB_MISSING_SIZE_SPECIFICATION = 2008,
  ESLURM_INVALID_GRES = 2072,
}

local function eslurm(name)
  return slurm[name] or ESLURM_FALLBACK[name]
end

-- Unset numeric fields arrive as NO_VAL (4294967294) or NO_VAL64.
local function num(v)
  if type(v) ~= "number" or v >= 4294967294 then
    return nil
  end
  return v
end

local slurm_user_uid_cache = false
local function slurm_user_uid()
  if slurm_user_uid_cache == false then
    slurm_user_uid_cache = nil
    local f = io.open(M.passwd_file, "r")
    if f then
      for line in f:lines() do
        local name, uid = line:match("^([^:]*):[^:]*:(%d+):")
        if name == SLURM_USER then
          slurm_user_uid_cache = tonumber(uid)
          break
        end
      end
      f:close()
    end
  end
  return slurm_user_uid_cache
end

-- "gres:gpu:h100:2,gres:gpu:a100:1,gres:mps:50" -> {gpu = {count = 3}, mps = {count = 50}}: every
-- entry of a name counts (typed entries add up: "gres:gpu:big:9,gres:gpu:small:1" is 10
-- GPUs; keeping only the last entry let such a request past the caps). A count has at most
-- 9 digits, so sums stay exact.
local function parse_tres(s)
  local out = {}
  if s == nil then
    return out
  end
  for item in string.gmatch(s, "[^,]+") do
    local spec = item:gsub("^gres[:/]", "")
    local f = {}
    for part in string.gmatch(spec, "[^:]+") do
      f[#f + 1] = part
    end
    local name, count = f[1], 1
    local function digits(x)
      return x:match("^%d%d?%d?%d?%d?%d?%d?%d?%d?$") and tonumber(x) or nil
    end
    if #f == 2 then
      if f[2]:match("^%d+$") then
        count = digits(f[2])
      end
    elseif #f == 3 then
      count = digits(f[3])
    elseif #f > 3 then
      count = nil
    end
    if name == nil or count == nil then
      return nil, "cannot read the request '" .. item .. "'"
    end
    local entry = out[name] or {count = 0}
    entry.count = entry.count + count
    out[name] = entry
  end
  return out
end

local function parse_marker(comment)
  if comment == nil or comment:sub(1, #MARKER_PREFIX) ~= MARKER_PREFIX then
    return nil, "no slurm-dlrm marker in --comment (the wrapper sets --comment=" .. MARKER_PREFIX .. "mode=...)"
  end
  local fields = {}
  for pair in string.gmatch(comment:sub(#MARKER_PREFIX + 1), "[^,]+") do
    local key, value = pair:match("^([a-z_]+)=([A-Za-z0-9._-]+)$")
    if key == nil then
      return nil, "bad field '" .. pair .. "' in the --comment marker"
    end
    fields[key] = value
  end
  if fields.mode == MODE_NO_PACK then
    local mib = fields.gpu_mem_mib and fields.gpu_mem_mib:match("^%d+$") and tonumber(fields.gpu_mem_mib)
    if not mib or mib < 1 then
      return nil, "the --comment marker of a no-pack job needs gpu_mem_mib=<MiB per GPU>"
    end
    fields.gpu_mem_mib = mib
  elseif fields.mode == MODE_PACK then
    if not (fields.pack_id and fields.pack_id:match("^%d+$")) then
      return nil, "the --comment marker of a pack needs pack_id=<number>"
    end
  else
    return nil, "the --comment marker needs mode=" .. MODE_NO_PACK .. " or mode=" .. MODE_PACK
  end
  return fields
end

-- The first enforcing DLRM partition the job asks for, or nil.
local function dlrm_partition(partition)
  local names = partition or DEFAULT_PARTITION
  if names == nil then
    return nil
  end
  for name in string.gmatch(names, "[^,]+") do
    local rule = PARTITIONS[name]
    if rule and rule.enforce then
      return name, rule
    end
  end
  return nil
end

local STRING_FIELDS = {"partition", "comment", "tres_per_node", "tres_per_job", "tres_per_socket",
                       "tres_per_task", "mem_per_tres"}
local NUMBER_FIELDS = {"min_mem_per_node", "min_mem_per_cpu", "min_nodes"}

-- The job as it will be: on modify, a field the request leaves unset keeps the job's value;
-- an empty string clears it.
local function view(desc, rec)
  local v = {}
  for _, f in ipairs(STRING_FIELDS) do
    local x = desc[f]
    if x == nil and rec ~= nil then
      x = rec[f]
    end
    if x == "" then
      x = nil
    end
    v[f] = x
  end
  for _, f in ipairs(NUMBER_FIELDS) do
    local x = num(desc[f])
    if x == nil and rec ~= nil then
      x = num(rec[f])
    end
    v[f] = x
  end
  return v
end

local function check_gres(v, rule, problem)
  local per_node, err1 = parse_tres(v.tres_per_node)
  local per_job, err2 = parse_tres(v.tres_per_job)
  if per_node == nil or per_job == nil then
    problem("ESLURM_INVALID_GRES", err1 or err2)
    return
  end
  for _, f in ipairs({"tres_per_socket", "tres_per_task"}) do
    local t = parse_tres(v[f]) or {}
    if t.gpu or t.mps then
      problem("ESLURM_INVALID_GRES", "ask for GPUs per node (--gres=gpu:N) or per job (--gpus=N), not per socket or task")
      return
    end
  end
  if per_node.shard or per_job.shard then
    problem("ESLURM_INVALID_GRES", "gres/shard is not taken here; slurm-dlrm asks for --gres=mps:N or --gres=gpu:N")
    return
  end
  local mps, gpu_node, gpu_job = per_node.mps or per_job.mps, per_node.gpu, per_job.gpu
  if mps and (gpu_node or gpu_job) then
    problem("ESLURM_INVALID_GRES", "ask for an MPS share or whole GPUs, not both")
  elseif mps then
    if not MPS_ENABLED then
      problem("ESLURM_INVALID_GRES", "this site does not offer gres/mps; ask for --gres=gpu:N")
    elseif per_job.mps then
      problem("ESLURM_INVALID_GRES", "ask for the MPS share per node: --gres=mps:N")
    elseif mps.count < rule.min_mps_share or mps.count > rule.max_mps_share then
      problem("ESLURM_INVALID_GRES", string.format("--gres=mps:%d is outside %d..%d (%d is one whole GPU)",
        mps.count, rule.min_mps_share, rule.max_mps_share, rule.max_mps_share))
    end
  elseif gpu_node or gpu_job then
    local nodes = v.min_nodes or 1
    -- Per job and per node may both be given: the larger total binds.
    local total = math.max(gpu_job and gpu_job.count or 0, gpu_node and gpu_node.count * nodes or 0)
    if gpu_node and (gpu_node.count < 1 or gpu_node.count > rule.max_gpus_per_node) then
      problem("ESLURM_INVALID_GRES", string.format("--gres=gpu:%d is outside 1..%d GPUs per node",
        gpu_node.count, rule.max_gpus_per_node))
    elseif total < 1 or total > rule.max_gpus_per_job then
      problem("ESLURM_INVALID_GRES", string.format("%d GPUs in all is outside 1..%d (max_gpus_per_job)",
        total, rule.max_gpus_per_job))
    end
  else
    problem("ESLURM_INVALID_GRES", "no GPU request: add --gres=mps:N (an MPS share) or --gres=gpu:N")
  end
end

-- One check for submit and modify. v: the job's fields (see view); uid: who asks.
-- Returns slurm.SUCCESS or an ESLURM code after telling the user why with slurm.log_user.
local function validate(v, uid)
  if uid == 0 or (uid ~= nil and uid == slurm_user_uid()) then
    return slurm.SUCCESS
  end
  local pname, rule = dlrm_partition(v.partition)
  if rule == nil then
    return slurm.SUCCESS
  end
  local problems = {}
  local function problem(code, text)
    problems[#problems + 1] = {code = code, text = text}
  end
  local marker, marker_err = parse_marker(v.comment)
  if marker == nil then
    problem("ESLURM_ACCESS_DENIED", marker_err)
  elseif marker.mode == MODE_NO_PACK and rule.gpu_mem_mib_max > 0 and marker.gpu_mem_mib > rule.gpu_mem_mib_max then
    problem("ESLURM_ACCESS_DENIED", string.format("gpu_mem_mib=%d in --comment exceeds the %d MiB of this partition's GPUs",
      marker.gpu_mem_mib, rule.gpu_mem_mib_max))
  end
  if not ((v.min_mem_per_node or 0) > 0 or (v.min_mem_per_cpu or 0) > 0 or v.mem_per_tres) then
    problem("ESLURM_JOB_MISSING_SIZE_SPECIFICATION",
      "no memory request: add --mem=<MiB>M (--mem=0, all of a node's memory, is not taken here)")
  end
  check_gres(v, rule, problem)
  if marker ~= nil and marker.mode == MODE_PACK then
    -- Packs ask for whole GPUs; a pack marker on an MPS share would pass the prolog
    -- unfenced (it fences only mode=no-pack), next to other users' fenced jobs.
    local per_node, per_job = parse_tres(v.tres_per_node) or {}, parse_tres(v.tres_per_job) or {}
    if per_node.mps or per_job.mps then
      problem("ESLURM_INVALID_GRES", "a pack (mode=pack in --comment) asks for whole GPUs (--gres=gpu:N), not --gres=mps:N")
    end
  end
  if #problems == 0 then
    return slurm.SUCCESS
  end
  local lines = {}
  for i, p in ipairs(problems) do
    lines[i] = "  - " .. p.text
  end
  slurm.log_user("%s", "slurm-dlrm: partition " .. pname .. " takes only jobs submitted through slurm-dlrm:\n"
    .. table.concat(lines, "\n") .. "\n" .. SUBMIT_HINT)
  return eslurm(problems[1].code)
end

-- MPS_ONE_USER: a gres/mps job in a DLRM partition runs with --exclusive=user, whoever
-- submits it (root's too). On modify only an update that names OverSubscribe is turned
-- back to USER: Slurm 22.05 refuses a user's update that changes it (so setting it on
-- every update would refuse them all), and the job kept USER from its submission.
local function one_user_per_gpu(job_desc, v, modify)
  if not (MPS_ENABLED and MPS_ONE_USER) then
    return
  end
  if modify and (job_desc.shared == nil or job_desc.shared == (slurm.NO_VAL16 or 65534)) then
    return
  end
  local _, rule = dlrm_partition(v.partition)
  if rule == nil then
    return
  end
  local per_node, per_job = parse_tres(v.tres_per_node) or {}, parse_tres(v.tres_per_job) or {}
  if per_node.mps or per_job.mps then
    job_desc.shared = slurm.JOB_SHARED_USER or 2
  end
end

-- What a site's job_submit.lua calls (docs/admin.md "Installs that chain"): the same
-- check for submit and modify; slurm.SUCCESS, or an ESLURM code after slurm.log_user.
function M.job_submit(job_desc, part_list, submit_uid)
  local v = view(job_desc, nil)
  local rc = validate(v, submit_uid)
  if rc == slurm.SUCCESS then
    one_user_per_gpu(job_desc, v, false)
  end
  return rc
end

function M.job_modify(job_desc, job_rec, part_list, modify_uid)
  local v = view(job_desc, job_rec)
  local rc = validate(v, modify_uid)
  if rc == slurm.SUCCESS then
    one_user_per_gpu(job_desc, v, true)
  end
  return rc
end

M.validate, M.view, M.parse_tres, M.parse_marker = validate, view, parse_tres, parse_marker

return M
