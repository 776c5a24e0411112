"""Which CPUs an in-process vLLM worker computes on: vLLM's CPU thread binding, done in the agent's process.

vLLM on CPU binds its worker's OpenMP threads only in its multiprocess
executor (``vllm.utils.ompmultiprocessing.OMPProcessManager``): by default
(``VLLM_CPU_OMP_THREADS_BIND=auto``) it keeps the last core
(``VLLM_CPU_NUM_OF_RESERVED_CPU``, default 1) for the engine-core / API
process and gives the worker the others, one OpenMP thread per core;
``nobind`` leaves threads alone; a CPU list (``0-3,5``) is used as given.
shoal's vllm engine runs the worker in the agent's process, beside the
agent's event loop, so :func:`plan_cpu_binding` picks the cores the same way
and the engine runs every model step on one dedicated thread pinned to them,
with that many torch (OpenMP) threads: one OpenMP team, never a pool of
threads each with its own. :func:`split_for_instances` gives each agent of
``shoal up`` its own cores when there are enough.

No torch or vLLM import; all pure but :func:`physical_cores`, which reads
Linux's CPU topology (the thread affinity is applied by the engine).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "BIND_ENV",
    "RESERVED_ENV",
    "CpuBinding",
    "format_cpu_list",
    "one_per_core",
    "parse_cpu_list",
    "physical_cores",
    "plan_cpu_binding",
    "split_for_instances",
]

#: vLLM's variable: ``auto`` (its default), ``nobind``, or CPU lists (``0-3|4-7``: one per worker).
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
#: vLLM's variable: how many CPUs ``auto`` keeps for everything but the model (default 1).
RESERVED_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """``"0-3,5"`` -> ``(0, 1, 2, 3, 5)`` (sorted, no repeats); a malformed list is a ValueError."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            low = int(first)
            high = int(last) if dash else low
        except ValueError:
            raise ValueError(f"CPU list {text!r}: {part!r} is not a CPU id or a range like 0-3") from None
        if low < 0 or high < low:
            raise ValueError(f"CPU list {text!r}: {part!r} is not a CPU id or a range like 0-3")
        cpus.update(range(low, high + 1))
    return tuple(sorted(cpus))


def format_cpu_list(cpus: Sequence[int]) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2,5"`` (the form :func:`parse_cpu_list` reads)."""
    parts: list[str] = []
    ordered = sorted(set(cpus))
    start = 0
    for i in range(1, len(ordered) + 1):
        if i == len(ordered) or ordered[i] != ordered[i - 1] + 1:
            low, high = ordered[start], ordered[i - 1]
            parts.append(str(low) if low == high else f"{low}-{high}")
            start = i
    return ",".join(parts)


@dataclass(frozen=True, slots=True)
class CpuBinding:
    """The model thread's CPUs (empty: not bound, threads as torch sets them) and where that came from."""

    cpus: tuple[int, ...]
    reserved: tuple[int, ...]
    source: str

    @property
    def num_threads(self) -> int | None:
        """OpenMP threads for the model (one per CPU), None when not bound."""
        return len(self.cpus) or None

    def describe(self) -> str:
        if not self.cpus:
            return f"vllm model thread not bound to CPUs ({self.source})"
        left = f", CPU {format_cpu_list(self.reserved)} left to the rest" if self.reserved else ""
        return (
            f"vllm model thread bound to CPU {format_cpu_list(self.cpus)} with {len(self.cpus)} "
            f"OpenMP thread(s){left} ({self.source})"
        )


def _reserve_count(environ: Mapping[str, str]) -> int:
    value = environ.get(RESERVED_ENV, "").strip()
    if not value:
        return 1
    try:
        count = int(value)
    except ValueError:
        raise ValueError(f"{RESERVED_ENV}={value!r}: expected a number of CPUs") from None
    if count < 0:
        raise ValueError(f"{RESERVED_ENV}={value!r}: expected a number of CPUs")
    return count


def one_per_core(cpus: Sequence[int], cores: Mapping[int, Hashable] | None) -> tuple[int, ...]:
    """The last logical CPU of each physical core (vLLM's ``auto`` on x86: no SMT siblings), sorted.

    ``cores`` maps a CPU id to its physical core (say ``(package, core_id)``);
    None, or a CPU it does not know, counts as a core of its own.
    """
    last: dict[Hashable, int] = {}
    for cpu in sorted(set(cpus)):
        key = ("cpu", cpu) if cores is None or cpu not in cores else cores[cpu]
        last[key] = cpu
    return tuple(sorted(last.values()))


def plan_cpu_binding(
    allowed: Sequence[int],
    environ: Mapping[str, str],
    requested: str | None = None,
    cores: Mapping[int, Hashable] | None = None,
) -> CpuBinding:
    """The binding of one in-process vLLM worker, chosen as vLLM's ``OMPProcessManager`` would.

    ``allowed``: the CPUs this process may use (``os.sched_getaffinity(0)``);
    ``requested``: shoal's ``--cpu-bind`` (wins over ``VLLM_CPU_OMP_THREADS_BIND``):
    ``auto``, ``nobind`` or a CPU list. ``auto`` takes one logical CPU per
    physical core (``cores``: CPU -> physical core, see :func:`one_per_core`)
    and keeps the last ``VLLM_CPU_NUM_OF_RESERVED_CPU`` (default 1) of them for
    the agent's loop when there are more than that, else binds to all. Bad
    input (a malformed list, CPUs outside ``allowed``, several lists for the
    one worker of an agent) is a ValueError saying so.
    """
    if requested:
        spec, source = requested.strip(), f"--cpu-bind {requested.strip()}"
    elif environ.get(BIND_ENV, "").strip():
        spec = environ[BIND_ENV].strip()
        source = f"{BIND_ENV}={spec}"
    else:
        spec, source = "auto", "auto, as vLLM's CPU worker"
    cpus = tuple(sorted(set(allowed)))
    if not cpus:
        raise ValueError("no CPU is allowed to this process")
    if spec == "nobind":
        return CpuBinding((), (), source)
    if spec == "auto":
        reserve = _reserve_count(environ)
        chosen = one_per_core(cpus, cores)
        if 0 < reserve < len(chosen):
            return CpuBinding(chosen[:-reserve], chosen[-reserve:], source)
        return CpuBinding(chosen, (), source)
    if "|" in spec:
        raise ValueError(
            f"{source}: one CPU list per agent (an agent runs one vLLM worker); "
            "'|'-separated lists are for `shoal up`, which gives one to each agent"
        )
    chosen = parse_cpu_list(spec)
    outside = sorted(set(chosen) - set(cpus))
    if outside:
        raise ValueError(
            f"{source}: CPU {format_cpu_list(outside)} not allowed to this process "
            f"(allowed: {format_cpu_list(cpus)})"
        )
    return CpuBinding(chosen, tuple(c for c in cpus if c not in chosen), source)


def split_for_instances(
    allowed: Sequence[int],
    instances: int,
    environ: Mapping[str, str],
    cores: Mapping[int, Hashable] | None = None,
) -> list[str]:
    """``--cpu-bind`` for each of ``shoal up``'s ``instances`` vllm agents.

    ``VLLM_CPU_OMP_THREADS_BIND``: ``nobind`` -> ``nobind`` for all; CPU lists
    separated by ``|`` -> agent i gets list i (modulo their number). Otherwise
    (``auto``, one logical CPU per physical core as :func:`plan_cpu_binding`):
    with more CPUs than agents, the last
    ``VLLM_CPU_NUM_OF_RESERVED_CPU`` (default 1, at most what leaves each agent
    one) stay free for the frontend, scheduler and the agents' loops, and the
    rest is cut into contiguous shares, one per agent; with as many or fewer
    CPUs than agents, agent i gets CPU i (modulo their number): shared, since
    there is nothing better.
    """
    if instances <= 0:
        return []
    spec = environ.get(BIND_ENV, "").strip() or "auto"
    if spec == "nobind":
        return ["nobind"] * instances
    if spec != "auto":
        lists = [part.strip() for part in spec.split("|")]
        for part in lists:
            parse_cpu_list(part)  # a malformed list is refused here, before anything starts
        return [lists[i % len(lists)] for i in range(instances)]
    cpus = list(one_per_core(allowed, cores))
    if not cpus:
        raise ValueError("no CPU is allowed to this process")
    if len(cpus) <= instances:
        return [str(cpus[i % len(cpus)]) for i in range(instances)]
    reserve = min(_reserve_count(environ), len(cpus) - instances)
    usable = cpus[: len(cpus) - reserve]
    share, extra = divmod(len(usable), instances)
    result, start = [], 0
    for i in range(instances):
        size = share + (1 if i < extra else 0)
        result.append(format_cpu_list(usable[start : start + size]))
        start += size
    return result


def physical_cores(cpus: Sequence[int], sysfs: str = "/sys/devices/system/cpu") -> dict[int, Hashable]:
    """CPU id -> (package, core id) from Linux's sysfs topology; CPUs it does not describe are left out."""
    cores: dict[int, Hashable] = {}
    for cpu in cpus:
        try:
            with open(f"{sysfs}/cpu{cpu}/topology/physical_package_id") as package_file:
                package = package_file.read().strip()
            with open(f"{sysfs}/cpu{cpu}/topology/core_id") as core_file:
                cores[cpu] = (package, core_file.read().strip())
        except OSError:
            continue
    return cores
