"""The doctor's verdicts: one `Check` per property, judged from the workers' reports against the layout.

Every collective is judged against the layout's num_processes, not against the world a worker saw: two
processes that each form a world of one (docs/accelerate-traps.md) pass a broadcast to themselves but sum
the all-reduce to 1 instead of 3, which is the fault to name. The reports are written by doctor/worker.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accel_trainer.doctor.worker import BROADCAST_VALUES

_NOT_ONE_GROUP = (
    "the processes did not form one group: on a machine without GPUs launch with a layout like cpu_ddp.yaml"
    " (distributed_type: MULTI_GPU, which torchrun starts) or with torchrun, not MULTI_CPU or --cpu without mpirun"
)
_COLLECTIVE_FIX = (
    "run again with TORCH_DISTRIBUTED_DEBUG=DETAIL (and NCCL_DEBUG=INFO on GPUs) to see the collective and ranks;"
    " name the network interface that connects the processes with GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME"
)
_PORT_WORDS = ("address already in use", "eaddrinuse", "another process is utilizing it")


@dataclass
class Check:
    """One line of the doctor's verdict: `ok`, `FAIL` (with the fix) or `skip` (an earlier check failed)."""

    status: str
    name: str
    text: str
    fix: str = ""

    def line(self) -> str:
        return f"{self.status:<4} {self.name}: {self.text}" + (f"; fix: {self.fix}" if self.fix else "")


def judge(
    layout: Any, path: Path, reports: list[dict], timed_out: bool, timeout_s: float, cuda_count: int
) -> list[Check]:
    """The rendezvous, world size, all-reduce, broadcast and device checks (and on a several-machine layout, the
    machines), from the reports of this machine's processes: all of the layout's, or its share on each machine."""
    expected = layout.num_processes if layout.distributed_type != "NO" else 1
    machines = max(1, layout.num_machines or 1)
    here = expected // machines
    joined = sorted((r for r in reports if r.get("rendezvous", {}).get("ok")), key=lambda r: r["rank"])
    checks = [
        _rendezvous(reports, joined, expected, here, timed_out, timeout_s),
        _world_size(reports, expected, here, path),
        _all_reduce(joined, expected, here),
        _broadcast(joined, expected, here),
        *([_machines(joined, machines)] if machines > 1 else []),
        _devices(layout, path, joined, here, cuda_count),
    ]
    for index, check in enumerate(checks):  # one cause, one fix: later lines point back to it
        earlier = [c.name for c in checks[:index] if c.fix == check.fix]
        if check.fix and earlier:
            check.fix = f"as for {earlier[0]}"
    return checks


def port_in_output(output: str, port: int) -> Check | None:
    """A FAIL naming the port when the launcher's output says the rendezvous address is taken; else None."""
    for line in output.splitlines():
        if any(words in line.lower() for words in _PORT_WORDS):
            return Check(
                "FAIL",
                "port",
                f"{port} is in use; the launcher says: {line.strip()[:200]}",
                "stop the process holding it, or pin a free main_process_port in the layout (0: any free"
                " port) or pass --main_process_port to accelerate launch",
            )
    return None


def _rendezvous(
    reports: list[dict], joined: list[dict], expected: int, here: int, timed_out: bool, timeout_s: float
) -> Check:
    """`here` of the `expected` processes are this machine's (all of them on a one-machine layout)."""
    refused = sorted((r for r in reports if "rendezvous" in r and not r["rendezvous"]["ok"]), key=lambda r: r["rank"])
    scope = f" on this machine ({expected} on all)" if here < expected else ""
    counts = f"{len(joined)} of {here} processes joined{scope}, {len(reports)} started"
    if refused:
        first = refused[0]
        fix = "" if first["rendezvous"]["user_error"] else "see the launcher's last lines below"
        text = f"{len(refused)} of {here} processes{scope} could not set up the layout; process {first['rank']}:"
        return Check("FAIL", "rendezvous", f"{text} {first['rendezvous']['error']}", fix)
    if timed_out:
        return Check(
            "FAIL",
            "rendezvous",
            f"{counts} within {timeout_s:g} s",
            "a process that started but never joined cannot reach MASTER_ADDR:MASTER_PORT or its peers"
            " (a firewall, the wrong interface: set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME); one that never"
            " started is in the launcher's last lines below",
        )
    if not reports:
        return Check("FAIL", "rendezvous", "the launcher started no process", "see the launcher's last lines below")
    if len(reports) < here:
        return Check(
            "FAIL",
            "rendezvous",
            f"the launcher started {len(reports)} of {here} processes{scope} and exited",
            _NOT_ONE_GROUP,
        )
    if len(joined) < here:
        return Check("FAIL", "rendezvous", f"{counts}; the launcher exited", "see the launcher's last lines below")
    if expected == 1:
        return Check("ok", "rendezvous", "1 of 1 process started (one process: no process group)")
    seconds = max(r["rendezvous"]["seconds"] for r in joined)
    where = ", ".join(sorted({f"{r['backend']}, {r['address']}, {r['distributed_type']}" for r in joined}))
    where += "".join(sorted({f", mesh {r['mesh']}" for r in joined if r["mesh"]}))
    return Check("ok", "rendezvous", f"{len(joined)} of {here} processes joined{scope} ({where}) in {seconds:.1f} s")


def _world_size(reports: list[dict], expected: int, here: int, path: Path) -> Check:
    worlds = [r["world_size"] for r in reports if r.get("world_size") is not None]
    if not worlds:
        return Check("skip", "world size", "no process got far enough to see its world")
    if worlds == [expected] * here:
        return Check("ok", "world size", f"every process sees a world of {expected}, num_processes in {path.name}")
    seen = ", ".join(map(str, worlds))
    return Check(
        "FAIL",
        "world size",
        f"{len(worlds)} process(es) saw worlds of {seen}; {path.name} asks for {expected} processes in one world",
        _NOT_ONE_GROUP,
    )


def _collective_results(joined: list[dict], key: str, name: str) -> tuple[list[tuple[int, dict]], Check | None]:
    """Each process's (rank, result) of one collective, and the check already decided: skipped when no process
    joined a group, failed on the first process that raised."""
    results = [(r["rank"], r[key]) for r in joined if key in r]
    if not results:
        return results, Check("skip", name, "no process joined a group")
    failed = [(rank, result["error"]) for rank, result in results if "error" in result]
    if failed:
        return results, Check("FAIL", name, f"process {failed[0][0]}: {failed[0][1]}", _COLLECTIVE_FIX)
    return results, None


def _all_reduce(joined: list[dict], expected: int, here: int) -> Check:
    results, decided = _collective_results(joined, "all_reduce", "all-reduce")
    if decided is not None:
        return decided
    want = expected * (expected + 1) // 2
    sums = [result["value"] for _, result in results]
    if sums == [want] * here:
        ms = 1000 * max(result["seconds"] for _, result in results)
        on = f"all {expected} processes" if here == expected else f"this machine's {here} of {expected} processes"
        return Check("ok", "all-reduce", f"the sum of rank+1 is {want} on {on} ({ms:.1f} ms)")
    got = ", ".join(f"process {rank} got {result['value']:g}" for rank, result in results)
    return Check("FAIL", "all-reduce", f"{got}; {expected} processes in one group make {want}", _NOT_ONE_GROUP)


def _broadcast(joined: list[dict], expected: int, here: int) -> Check:
    results, decided = _collective_results(joined, "broadcast", "broadcast")
    if decided is not None:
        return decided
    wrong = [rank for rank, result in results if result["value"] != BROADCAST_VALUES]
    if wrong:
        return Check("FAIL", "broadcast", f"process(es) {wrong} did not receive rank 0's tensor", _COLLECTIVE_FIX)
    indices = sorted(r["process_index"] for r in joined)
    if len(set(indices)) != here or not set(indices) <= set(range(expected)):
        shown = ", ".join(str(r["process_index"]) for r in joined)
        return Check(
            "FAIL",
            "broadcast",
            f"it ran, but not in one group of {expected} (process indices {shown})",
            _NOT_ONE_GROUP,
        )
    return Check("ok", "broadcast", f"all {len(results)} processes received rank 0's tensor {BROADCAST_VALUES}")


def _machines(joined: list[dict], machines: int) -> Check:
    """A several-machine layout: every machine's processes in the one group (gathered by each process)."""
    results, decided = _collective_results(joined, "machines", "machines")
    if decided is not None:
        return decided
    ranks_by_machine: dict[tuple[int, str], list[int]] = {}
    for machine, host, rank in results[0][1]["value"]:
        ranks_by_machine.setdefault((machine, host), []).append(rank)
    seen = "; ".join(
        f"machine {m} ({host}): process(es) {ranks}" for (m, host), ranks in sorted(ranks_by_machine.items())
    )
    if sorted({machine for machine, _ in ranks_by_machine}) == list(range(machines)):
        return Check("ok", "machines", f"{machines} of {machines} machines in the group: {seen}")
    return Check(
        "FAIL",
        "machines",
        f"the group holds {seen}, not machines 0 to {machines - 1}",
        "give each machine its own --machine_rank (0 on the machine whose address is --main_process_ip)",
    )


def _devices(layout: Any, path: Path, joined: list[dict], expected: int, cuda_count: int) -> Check:
    """CPU layouts: every process on the CPU; GPU layouts: one GPU of its own per process (`expected`: this
    machine's processes)."""
    on_cpu = bool(layout.use_cpu) or cuda_count == 0
    if not on_cpu and expected > cuda_count:
        return Check(
            "FAIL",
            "devices",
            f"{path.name} starts {expected} GPU processes and this machine has {cuda_count} GPU(s)",
            f"use a layout of at most {cuda_count} process(es) (gpu.yaml: one), or use_cpu: true",
        )
    if not joined:
        return Check("skip", "devices", "no process joined")
    placed = ", ".join(f"process {r['rank']} {r['device']}" for r in joined)
    if on_cpu:
        if all(r["device"].split(":")[0] == "cpu" for r in joined):
            return Check("ok", "devices", f"{placed} (a CPU layout{': no CUDA here' if cuda_count == 0 else ''})")
        return Check(
            "FAIL",
            "devices",
            f"{placed}: a CPU layout placed tensors on a GPU",
            "set use_cpu: true in the layout, or ACCELERATE_USE_CPU=1",
        )
    if not all(r["device"].startswith("cuda") for r in joined):
        return Check(
            "FAIL",
            "devices",
            f"{placed}: a GPU layout on a machine with {cuda_count} GPU(s)",
            "the workers see no GPU: check CUDA_VISIBLE_DEVICES and gpu_ids in the layout",
        )
    if len({(r["host"], r["device"]) for r in joined}) < len(joined):
        return Check(
            "FAIL",
            "devices",
            f"{placed}: processes share a GPU",
            "each process needs a GPU of its own: num_processes at most the GPUs it may see (gpu_ids,"
            " CUDA_VISIBLE_DEVICES)",
        )
    return Check("ok", "devices", f"{placed} (one GPU per process)")
