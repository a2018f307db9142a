"""The job spec: what an operator submits (YAML or JSON), validated before anything is stored.

Every model forbids unknown fields, so a typo (``num_node:``) is an error naming the
field rather than a silently ignored setting. ``parse_job_spec_yaml`` refuses YAML
aliases (the "billion laughs" bomb), oversized documents and nesting too deep for the
parser before parsing further.

Every value must be storable as it is on SQLite and PostgreSQL and readable back:
``storage_refusal`` walks a parsed document (a spec, an event, an agent's report) and
names the first value that is not (a NUL character, which PostgreSQL cannot store; an
unpaired surrogate, which is not Unicode text and cannot be encoded; a non-finite
number; an integer beyond 64 bits; nesting or size past the limits). Numbers have
upper bounds: a count of 10**30 is a typo, and the database's integer columns hold
32 or 64 bits. Paths refuse ``..``: a template name or a checkpoint URI never
reaches outside where it points.
The format is documented in the README; ``task_templates/job.example.yaml`` is a
complete example.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from orchestrator.contract import Cloud

MAX_SPEC_BYTES = 256 * 1024
#: The deepest nesting a free-form JSON value (event details, a report's ``detail``)
#: may have. The agent's deepest (a Flight Recorder summary) is 5 levels.
MAX_JSON_DEPTH = 32
#: The largest a document may be, in characters of its strings and keys plus 8 per
#: other value (about its JSON size): a backstop, as the service's body limits
#: (api/limits.py) are tighter.
MAX_JSON_CHARS = 8 * 1024 * 1024
#: The largest a free-form ``detail`` inside an agent's report may be (same measure).
MAX_DETAIL_CHARS = 64 * 1024
#: The largest integer any column holds (BIGINT; SQLite's INTEGER is the same).
INT64_MAX = 2**63 - 1
#: The largest value of a 32-bit integer column (steps, ranks, attempt numbers).
INT32_MAX = 2**31 - 1

# "A100:8", "H100-80GB:8", "L4", "tpu-v5e-8"; or memory forms "nvidia:40GB+:8", "80GB:8".
_ACCEL_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.\-]*(:[1-9][0-9]*)?$")
_ACCEL_MEMORY = re.compile(
    r"^((nvidia|amd|google):)?[1-9][0-9]*GB\+?(:[1-9][0-9]*)?$", re.IGNORECASE
)
_NAME = re.compile(r"^[a-z0-9][a-z0-9\-_.]{0,62}$")



class SpecError(ValueError):
    """An invalid spec. ``errors`` holds (field path, reason) pairs."""

    def __init__(self, errors: list[tuple[str, str]]) -> None:
        self.errors = errors
        super().__init__("; ".join(f"{loc}: {msg}" if loc else msg for loc, msg in errors))


def _unstorable_str(s: str) -> str | None:
    if "\x00" in s:
        return "NUL characters (\\u0000) are not allowed (PostgreSQL cannot store them)"
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            return (
                f"not valid Unicode text: an unpaired surrogate {s[e.start]!r} at index "
                f"{e.start} (send text as UTF-8, not escaped halves of a character)"
            )
    return None


def storage_refusal(
    value: Any, *, where: str = "", max_depth: int = MAX_JSON_DEPTH, max_chars: int = MAX_JSON_CHARS
) -> str | None:
    """Why ``value`` (parsed JSON or YAML) cannot be stored and read back, naming the
    first bad place as a dotted path; None when it can.

    Iterative, so a deep document costs no recursion (the limit is ``max_depth``)."""
    budget = max_chars
    stack: list[tuple[Any, str, int]] = [(value, where, 0)]
    while stack:
        v, at, depth = stack.pop()
        name = at or "the body"
        if isinstance(v, str):
            budget -= len(v)
            why = _unstorable_str(v)
            if why:
                return f"{name}: {why}"
        elif isinstance(v, bool) or v is None:
            budget -= 8
        elif isinstance(v, int):
            budget -= 8
            if not -INT64_MAX - 1 <= v <= INT64_MAX:
                return f"{name}: the integer {str(v)[:40]} is beyond 64 bits"
        elif isinstance(v, float):
            budget -= 8
            if not math.isfinite(v):
                return f"{name}: {v} is not a finite number (JSON has no NaN or Infinity)"
        elif isinstance(v, dict | list | tuple):
            if depth >= max_depth:
                return f"{name}: nested deeper than {max_depth} levels"
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, child in items:
                key = str(k)
                if isinstance(v, dict):
                    budget -= len(key)
                    why = _unstorable_str(key)
                    if why:
                        return f"{name}: the key {key[:40]!r}: {why}"
                stack.append((child, f"{at}.{key}" if at else key, depth + 1))
        else:
            budget -= 8
        if budget < 0:
            return f"{name}: the value is larger than {max_chars} characters"
    return None


def refuse_unstorable(value: Any, **kw: Any) -> Any:
    """``storage_refusal`` as a pydantic before-validator: raises ValueError naming it."""
    why = storage_refusal(value, **kw)
    if why:
        raise ValueError(why)
    return value


def _no_parent_segments(path: str, what: str) -> None:
    if ".." in re.split(r"[/\\]", path):
        raise ValueError(f"{path[:200]!r}: {what} may not contain '..' (no path traversal)")


#: A template is a file name in ``task_templates/`` (without ``.yaml``), never a path.
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_TEMPLATE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-]*(\.[A-Za-z0-9_\-]+)*$")


class _Strict(BaseModel):
    # No NaN or Infinity: a timeout of Infinity is a typo, and JSON cannot carry it.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class TaskSpec(_Strict):
    """What runs on every node: a template from ``task_templates/`` with a command,
    or a user's own SkyPilot task YAML (used unchanged)."""

    template: str | None = None
    skypilot_yaml: str | None = None
    command: str | None = None
    """The training command, run by the node agent under torchrun."""
    envs: dict[str, str] = Field(default_factory=dict, max_length=256)
    """The task's ``envs`` as SkyPilot takes them (``--env KEY=VALUE``): they fill a
    SkyPilot YAML's empty ones and override the rest."""
    secrets: dict[str, str] = Field(default_factory=dict, max_length=256, repr=False)
    """As SkyPilot's ``secrets:`` (``--secret KEY=VALUE``): passed to the task as
    SkyPilot passes secrets, shown as ``<redacted>`` in every API answer. Out of the
    repr, so a logged spec or launch request (``%s`` of a dataclass holding the task)
    never carries a value."""
    framework: Literal["skyresume", "hf", "accelerate", "lightning", "plain"] = "skyresume"
    """``skyresume``: the script uses ``training.Run`` (it reports what it resumed from
    and its steps, saves on SIGTERM and exits 75). ``hf``, ``accelerate``,
    ``lightning``: a Hugging Face Trainer, Accelerate or Lightning script under
    ``training.integrations`` (the same contract as ``skyresume``, the framework's own
    checkpoint format; ``skyresume plan`` names the knobs in its terms). ``plain``: it
    imports nothing of skyresume and runs under the plain-script contract (README): no
    resume report is waited for, exit 0 is success, a restart passes ``checkpoint.own``
    or starts from scratch. Left at ``skyresume``, a script that sends no reports is
    noticed at run time and put under the same contract (one ``plain_script`` event
    says so)."""

    @field_validator("template")
    @classmethod
    def _template(cls, v: str | None) -> str | None:
        if v is not None and (len(v) > 64 or not _TEMPLATE.match(v)):
            raise ValueError(
                f"{v[:80]!r} is not a template name: use the name of a file in "
                "task_templates/ without .yaml (letters, digits, '-', '_', '.'; no path)"
            )
        return v

    @field_validator("envs", "secrets")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        for k in v:
            if not _ENV_KEY.match(k):
                raise ValueError(f"{k[:80]!r} is not an env name (letters, digits, '_')")
        return v

    @field_validator("skypilot_yaml")
    @classmethod
    def _skypilot_yaml(cls, v: str | None) -> str | None:
        if v is not None:
            _no_parent_segments(v, "a SkyPilot YAML path")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> TaskSpec:
        if bool(self.template) == bool(self.skypilot_yaml):
            raise ValueError("give exactly one of template or skypilot_yaml")
        if self.template and not self.command:
            raise ValueError("a template needs a command")
        return self


class AcceleratorChoice(_Strict):
    """SkyPilot's two forms of several accelerator options."""

    ordered: list[str] | None = None
    """Strict preference: the first option with capacity wins, whatever its price."""
    any_of: list[str] | None = None
    """A free choice: ranked by cost."""

    @model_validator(mode="after")
    def _one(self) -> AcceleratorChoice:
        if (self.ordered is None) == (self.any_of is None):
            raise ValueError("give exactly one of ordered or any_of")
        if not self.names:
            raise ValueError("needs at least one accelerator")
        return self

    @property
    def names(self) -> list[str]:
        return list(self.ordered if self.ordered is not None else self.any_of or [])


class ModelProfile(_Strict):
    """Enough of the model for the memory planner to estimate bytes per GPU."""

    parameters: int = Field(gt=0, le=10**15)
    layers: int = Field(gt=0, le=100_000)
    hidden_size: int = Field(gt=0, le=10**7)
    heads: int = Field(gt=0, le=100_000)
    seq_len: int = Field(gt=0, le=10**9)
    global_batch: int = Field(
        gt=0, le=INT32_MAX, description="sequences per optimizer step, all ranks"
    )
    micro_batch: int = Field(gt=0, le=INT32_MAX, description="sequences per rank per forward pass")
    dtype: Literal["fp32", "bf16", "fp16"] = "bf16"
    optimizer_bytes_per_param: float = Field(default=12.0, gt=0, le=1024)
    sharding: Literal["ddp", "fsdp"] = "ddp"

    @model_validator(mode="after")
    def _batch(self) -> ModelProfile:
        if self.micro_batch > self.global_batch:
            raise ValueError("micro_batch cannot exceed global_batch")
        if self.hidden_size % self.heads:
            raise ValueError("hidden_size must be divisible by heads")
        return self


class OwnCheckpoint(_Strict):
    """Where a plain script keeps its own checkpoint (the tutorial's ``snapshot.pt``),
    and the argument that tells it to resume from there."""

    path: str = Field(min_length=1, max_length=4096)
    """A file or directory on the node: absolute, or under ``{node_disk}`` (the node's
    own disk, which survives only on a node the restart keeps), or on storage the nodes
    share. The service never copies it."""
    resume_arg: str = Field(min_length=1, max_length=128)
    """Appended by each node's agent as ``<resume_arg> <path>`` to the command when the
    path exists on that node (e.g. ``--snapshot_path``); not appended where it does
    not, so that node's ranks start as the script would without it."""

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        _no_parent_segments(v, "checkpoint.own.path")
        if not (v.startswith("/") or v.startswith("{node_disk}")):
            raise ValueError(f"{v[:200]!r}: give an absolute path or one under {{node_disk}}")
        return v

    @field_validator("resume_arg")
    @classmethod
    def _arg(cls, v: str) -> str:
        if not re.match(r"^-{1,2}[A-Za-z0-9][A-Za-z0-9_\-]*$", v):
            raise ValueError(f"{v[:80]!r} is not a command-line option (like --snapshot_path)")
        return v


class CheckpointSpec(_Strict):
    uri: str
    """file:///abs/path, s3://bucket/prefix or gs://bucket/prefix."""
    every_steps: int = Field(default=100, ge=1, le=INT32_MAX)
    keep: int = Field(
        default=3, ge=2, le=1000, description="complete checkpoints kept (at least 2)"
    )
    adaptive: bool = True
    """Let the service move ``every_steps`` to Young's interval for the measured save
    time and failure rate while the job runs (pushed to the ranks when it changes by
    20 % or more). Off: ``every_steps`` stays as written."""
    own: OwnCheckpoint | None = None
    """A plain script's own checkpoint: a restart resumes from it (``task.framework:
    plain``, or a script noticed sending no reports). None: such a script restarts
    from scratch, and the status says so."""

    @field_validator("uri")
    @classmethod
    def _uri(cls, v: str) -> str:
        m = re.match(r"^(file|s3|gs)://(.*)$", v)
        if not m:
            raise ValueError(f"{v!r} must start with file://, s3:// or gs://")
        scheme, rest = m.groups()
        _no_parent_segments(rest, "a checkpoint URI")
        if scheme == "file" and not rest.startswith("/"):
            raise ValueError(f"{v!r}: file:// needs an absolute path (file:///path)")
        if scheme in ("s3", "gs") and not re.match(r"^[a-z0-9][a-z0-9.\-_]{1,62}(/|$)", rest):
            raise ValueError(f"{v!r}: missing or invalid bucket name")
        return v


class RestartPolicy(_Strict):
    max_restarts: int = Field(default=10, ge=0, le=100_000)
    heartbeat_timeout_s: float = Field(default=30.0, gt=0, le=86400)
    provision_timeout_s: float = Field(default=900.0, gt=0, le=86400)
    """How long a launch may take to provision (a cloud takes minutes) before that
    placement is given up on like a stockout: cooled down, the job re-planned. The
    register timeout is separate and starts only once the nodes are up."""
    grace_period_s: float = Field(
        default=90.0, gt=0, le=86400, description="time ranks get to save"
    )
    max_same_user_error: int = Field(default=2, ge=1, le=100_000)
    """The same user code error (exception type and message) this many times fails
    the job: the bug is in the script, and a restart reproduces it."""
    on_anomaly: Literal["rollback", "rollback_skip", "fail"] = "rollback"
    """NaN/Inf or a persistent loss spike: resume from the newest checkpoint older than
    the onset (rollback), also skip the batches around it (rollback_skip), or stop."""
    max_same_anomaly: int = Field(default=2, ge=1, le=100_000)
    """The same anomaly at the same step this many times fails the job."""
    skip_after_onset: int = Field(default=10, ge=0, le=INT32_MAX)
    """rollback_skip: steps past the onset whose batches are skipped too."""
    validate_timeout_s: float | None = Field(default=None, gt=0, le=7 * 86400)
    """How long an attempt's ranks may take from the nodes being up to each reporting
    what they resumed from (start-up, staging, loading). None: three times the longest
    start-up this job measured, at least a floor (the service's default with nothing
    measured). Past it, ranks still using CPU or making steps are never stopped."""
    exit_zero_is_success: bool = True
    """Every rank exiting 0 ends the job SUCCEEDED, in every protocol step. False for a
    script that exits 0 when SIGTERM stops it: an all-zero exit after the service asked
    the ranks to stop (an incident's SIGNAL) is then read as stopped, and restarted."""


class ElasticPolicy(_Strict):
    """How an elastic run (``min_nodes`` below ``num_nodes``) keeps its math when it
    trains on fewer nodes than the spec's ``num_nodes`` (``domain.elastic``)."""

    batch: Literal["keep", "scale"] = "keep"
    """``keep``: the global batch stays the spec's on any world size, each rank
    accumulating more (the math of an uninterrupted run). ``scale``: the global batch
    follows the world size (``global_batch * world / full world``) and the learning
    rate follows ``lr``."""
    lr: Literal["linear", "sqrt"] = "linear"
    """With ``batch: scale``: the learning rate times ``world / full`` (linear) or its
    square root (sqrt)."""
    shrink: Literal["auto", "always", "never"] = "auto"
    """``auto``: shrink onto the survivors when the expected wait for a replacement
    (measured from the placement history) costs more training than the two reshapes
    (shrink, then grow) do; ``always``: shrink whenever the survivors are enough;
    ``never``: wait for a full set, as a job without ``min_nodes`` does."""
    expected_provision_s: float | None = Field(default=None, gt=0, le=7 * 86400)
    """The replacement's expected provisioning time when nothing was measured for the
    placement yet. None: the service's default (``ElasticConfig``)."""


class JobSpec(_Strict):
    name: str
    task: TaskSpec
    num_nodes: int = Field(default=1, ge=1, le=4096)
    """Nodes every attempt runs on. A template job must give it. A job whose task is a
    SkyPilot YAML may leave it out: the YAML's own ``num_nodes`` (SkyPilot's default,
    1) is used, filled in when the job is submitted; given, it overrides the YAML's
    (``skyresume plan`` says which was used: :func:`with_task_num_nodes`)."""
    min_nodes: int | None = Field(default=None, ge=1, le=4096)
    """Elastic runs may continue on fewer nodes, down to this. Default: num_nodes."""
    ranks_per_node: int = Field(default=1, ge=1, le=64)
    accelerators: list[str] | AcceleratorChoice = Field(default_factory=list)
    """Candidates; empty for CPU-only runs. A plain list (or ``any_of: [...]``) is a
    free choice ranked by cost, the list's order breaking ties; ``ordered: [...]`` is
    a strict preference, as in SkyPilot's task YAML."""
    spot: bool | None = None
    """Spot or on-demand for every node. None (not given): a SkyPilot task YAML's own
    ``use_spot``, per resource option, and spot for a template job; given, it overrides
    the YAML's."""
    clouds: list[Cloud] = Field(default_factory=list, max_length=64)
    regions: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(
        default_factory=list, max_length=256
    )
    model: ModelProfile | None = None
    checkpoint: CheckpointSpec
    restarts: RestartPolicy = Field(default_factory=RestartPolicy)
    elastic: ElasticPolicy = Field(default_factory=ElasticPolicy)
    """Only read when ``min_nodes`` is below ``num_nodes``."""

    @model_validator(mode="before")
    @classmethod
    def _storable(cls, doc: Any) -> Any:
        return refuse_unstorable(doc)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError("use 1-63 lower-case letters, digits, '-', '_' or '.'")
        return v

    @field_validator("accelerators")
    @classmethod
    def _accels(cls, v: list[str] | AcceleratorChoice) -> list[str] | AcceleratorChoice:
        for a in v if isinstance(v, list) else v.names:
            if not (_ACCEL_NAME.match(a) or _ACCEL_MEMORY.match(a)):
                raise ValueError(
                    f"{a!r} is not an accelerator: use NAME[:COUNT] (A100:8) "
                    "or a memory form (nvidia:40GB+:8)"
                )
        return v

    @property
    def accelerator_names(self) -> list[str]:
        a = self.accelerators
        return list(a) if isinstance(a, list) else a.names

    @property
    def accelerators_ordered(self) -> bool:
        """SkyPilot's ``ordered:``: the first option with capacity wins, whatever its
        price. A plain list or ``any_of:`` is a free choice ranked by cost."""
        return (
            isinstance(self.accelerators, AcceleratorChoice)
            and self.accelerators.ordered is not None
        )

    @model_validator(mode="after")
    def _nodes(self) -> JobSpec:
        if not self.num_nodes_given:
            if not self.task.skypilot_yaml:
                raise ValueError(_NODES_REQUIRED)
            return self  # the YAML's count, checked once it is filled in
        if self.min_nodes is not None and self.min_nodes > self.num_nodes:
            raise ValueError(f"min_nodes ({self.min_nodes}) exceeds num_nodes ({self.num_nodes})")
        self._elastic_batch()
        return self

    def _elastic_batch(self) -> None:
        """An elastic run's global batch must split evenly over every world size it may
        train on (``keep``), or scale to a whole batch that does (``scale``)."""
        if self.model is None or not self.elastic_nodes:
            return
        g, per = self.model.global_batch, self.ranks_per_node
        for n in self.elastic_nodes:
            world = n * per
            if self.elastic.batch == "keep" and g % world:
                raise ValueError(
                    f"model.global_batch {g} cannot be split evenly over {world} ranks "
                    f"({n} nodes x {per}), a world size between min_nodes "
                    f"({self.effective_min_nodes}) and num_nodes ({self.num_nodes}) may "
                    "train on (elastic.batch: keep)"
                )
        full = self.num_nodes * per
        if self.elastic.batch == "scale" and g % full:
            # g/full per rank on every world: a whole, evenly split batch on any size.
            raise ValueError(
                f"model.global_batch {g} does not split evenly over the full {full} ranks, so "
                "it cannot scale to a whole batch on fewer nodes (elastic.batch: scale)"
            )

    @property
    def elastic_nodes(self) -> tuple[int, ...]:
        """The smaller node counts an elastic run may train on, largest first (empty
        when ``min_nodes`` is ``num_nodes``: the job waits for a full set)."""
        return tuple(range(self.num_nodes - 1, self.effective_min_nodes - 1, -1))

    @property
    def num_nodes_given(self) -> bool:
        """Whether the spec itself says ``num_nodes`` (a stored spec always does: the
        service fills in the YAML's at submit)."""
        return "num_nodes" in self.model_fields_set

    @property
    def effective_min_nodes(self) -> int:
        return self.min_nodes or self.num_nodes


_NODES_REQUIRED = (
    "num_nodes: required for a template job (only a SkyPilot YAML's job may leave it "
    "to the YAML's num_nodes)"
)


def with_task_num_nodes(spec: JobSpec, yaml_nodes: int) -> tuple[JobSpec, str]:
    """``spec`` with its SkyPilot YAML's ``num_nodes`` where the spec gives none, and
    one line saying which was used. The YAML is what the user already runs with
    ``sky launch``: a spec that says nothing must not quietly change it (#26); a spec
    that says something overrides it, as SkyPilot's ``--num-nodes`` does. SpecError
    when the filled-in spec is invalid (a ``min_nodes`` above the YAML's count)."""
    if spec.num_nodes_given:
        if spec.num_nodes == yaml_nodes:
            return spec, f"nodes: {spec.num_nodes} (the job spec and the YAML agree)"
        return spec, f"nodes: {spec.num_nodes} from the job spec (the YAML says {yaml_nodes})"
    filled = validate_job_spec({**spec.model_dump(mode="json"), "num_nodes": yaml_nodes})
    return filled, f"nodes: {yaml_nodes} from the YAML's num_nodes (the job spec sets none)"


def task_spot_note(spec: JobSpec) -> str:
    """One line saying which of the spec and its SkyPilot YAML decides spot."""
    if spec.spot is None:
        return "spot: the YAML's use_spot, per resource option (the spec sets none)"
    return f"spot: {spec.spot} from the job spec (overrides the YAML's use_spot)"


def _errors(e: ValidationError) -> list[tuple[str, str]]:
    out = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        if not loc and msg == _NODES_REQUIRED:  # a model check, about one field
            loc, msg = msg.split(": ", 1)
        out.append((loc, msg))
    return out


def validate_job_spec(doc: Any) -> JobSpec:
    if not isinstance(doc, dict):
        raise SpecError([("", f"a job spec must be a mapping, got {type(doc).__name__}")])
    try:
        return JobSpec.model_validate(doc)
    except ValidationError as e:
        errors = _errors(e)
        task = doc.get("task")
        yaml_task = isinstance(task, dict) and bool(task.get("skypilot_yaml"))
        if "num_nodes" not in doc and not yaml_task and not _names_nodes(errors):
            errors.append(("num_nodes", "Field required"))  # the model check did not run
        raise SpecError(errors) from None


def _names_nodes(errors: list[tuple[str, str]]) -> bool:
    return any(loc == "num_nodes" for loc, _ in errors)


class _NoAliasLoader(yaml.SafeLoader):
    """SafeLoader that refuses aliases: a few lines of anchors can expand to gigabytes."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call]
            line = event.start_mark.line + 1
            raise SpecError([("", f"line {line}: YAML aliases (*{event.anchor}) are not allowed")])
        # Composing recurses once per level: 1,000 levels ("[[[[...") cost seconds to
        # reach Python's recursion limit, so nesting is counted and cut off first.
        self._depth += 1
        try:
            if self._depth > MAX_JSON_DEPTH:
                line = self.peek_event().start_mark.line + 1  # type: ignore[no-untyped-call]
                raise SpecError(
                    [("", f"line {line}: YAML nested deeper than {MAX_JSON_DEPTH} levels")]
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def load_yaml_document(text: str | bytes, *, what: str = "job spec") -> Any:
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError([("", f"{what} is {len(text)} bytes; the limit is {MAX_SPEC_BYTES}")])
    try:
        return yaml.load(text, Loader=_NoAliasLoader)
    except RecursionError:  # PyYAML composes nested nodes recursively: [[[[...]]]]
        raise SpecError([("", f"unreadable YAML: the {what} is nested too deeply")]) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise SpecError([("", f"unreadable YAML: {where}{problem}")]) from None


def parse_job_spec_yaml(text: str | bytes) -> JobSpec:
    return validate_job_spec(load_yaml_document(text))
