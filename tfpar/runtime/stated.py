"""What an automatic plan says of itself (issue "Say what you did"): its
estimate's assumptions and how the search found it, as data of the plan
(``estimate_of``), and as fallbacks (``tfpar.fallback``) where the search
did less than it was asked - stopped early, or let a time limit decide a
stage cut or a sharding - or advice where a memory technique the config
left out would make it much faster (``say_how_it_was_found``).
"""
from typing import Any, Dict, List, Optional, Sequence

from tfpar import fallback
from tfpar.cluster.hardware import Hardware
from tfpar.ir.outcome import Outcome
from tfpar.ir.plan import TaskGraphPlan
from tfpar.planner.candidate import Candidate
from tfpar.planner.choice import faster_with_techniques
from tfpar.planner.costing import SOLVE_SHARE, STAGE_ILP_SHARE
from tfpar.planner.meshes import meshes_named
from tfpar.planner.roofline import LOW_PRECISION
from tfpar.planner.verdicts import candidate_rows, memory_parts

__all__ = ["assumptions", "batch_from", "estimate_of", "memory_per_device",
           "say_how_it_was_found", "say_stage_cut"]

_MORE = "Raise auto.search_time_limit_s"


def estimate_of(candidate: Candidate, rt, candidates: Sequence[Candidate] = (),
                task_graphs: Sequence[TaskGraphPlan] = ()) -> Dict[str, Any]:
    """A plan's ``estimate`` from a search candidate: its step, memory per
    device (``memory_per_device``; what fills its fullest device:
    ``memory``) and traffic, its memory techniques, what it assumes and how
    it was found; with the search's ``candidates``, each with why it lost
    (``planner.verdicts``)."""
    techniques = candidate.techniques
    rows = (candidate_rows(candidates, candidate, candidate.search.hardware)
            if candidates and candidate.search is not None else [])
    return {"step_time_s": candidate.step_time_s,
            "memory_bytes_per_device": memory_per_device(candidate, rt.devices, task_graphs),
            "memory": memory_parts(candidate),
            "comm_bytes": candidate.comm_bytes,
            "memory_techniques": techniques.names,
            **({"recompute": techniques.recompute} if techniques.recompute != "none" else {}),
            **({"zero": techniques.zero} if techniques.zero else {}),
            **_assumed(candidate, rt), **_found(candidate),
            **({"candidates": rows} if rows else {})}


def memory_per_device(candidate: Candidate, devices: Sequence[str],
                      task_graphs: Sequence[TaskGraphPlan] = ()) -> List[float]:
    """Bytes per device of ``devices`` (in name order, as annotated plans
    list them): its stage's estimate when ``task_graphs`` are the
    candidate's stages, else the fullest device's everywhere."""
    if not task_graphs or len(task_graphs) != len(candidate.stage_memory):
        return [candidate.memory_bytes] * len(devices)
    of_device = {d: memory for tg, memory in zip(task_graphs, candidate.stage_memory)
                 for d in tg.devices}
    return [of_device.get(d, 0.0) for d in sorted(devices)]


def _assumed(candidate: Candidate, rt) -> Dict[str, Any]:
    """The device, dtype, peak, efficiency, memory, optimizer slots per
    weight (``ModelView.optimizer_slots``) and batch the estimate assumes,
    and the FLOPs it counts: the model's (3 x forward) and those its
    recomputation runs again (hardware FLOPs are both)."""
    record = candidate.search
    if record is None:
        return {}
    hardware = record.hardware
    dtype = LOW_PRECISION if candidate.techniques.mixed_precision else record.dtype
    model, again = candidate.flops
    device_seconds = candidate.step_time_s * record.num_devices * 1e12
    said_batch = batch_from(rt, record.batch_known)
    return {"assumptions": assumptions(hardware, dtype, record.num_devices,
                                       record.optimizer_slots, record.global_batch, said_batch),
            "flops_per_step": model, "recomputed_flops_per_step": again,
        "model_tflops_per_device": model / device_seconds if device_seconds else 0.0,
        "hardware_tflops_per_device": (model + again) / device_seconds if device_seconds
        else 0.0}


def assumptions(hardware: Hardware, dtype: str, devices: int, slots: float, batch: int,
                said_batch: str) -> Dict[str, Any]:
    """What an estimate assumes (``estimate.assumptions``, the summary's
    ``assumes:`` line): ``devices`` of ``hardware`` computing in ``dtype``,
    ``slots`` optimizer slots per weight, a global ``batch`` (from where
    ``said_batch`` says)."""
    return {"device": hardware.name, "devices": devices,
            "devices_per_node": hardware.devices_per_node, "compute_dtype": dtype,
            "peak_dtype": hardware.peak_name(dtype), "peak_tflops": hardware.peak(dtype),
            "efficiency": hardware.efficiency, "memory_gbps": hardware.memory_gbps,
            "memory_gb": hardware.memory_gb, "optimizer_slots": slots,
            "global_batch": batch, "batch_from": said_batch}


def batch_from(rt, known: bool) -> str:
    """Where the batch an estimate assumes comes from (``known``: the model's
    inputs declare one)."""
    return ("auto.global_batch" if rt.config.get("auto.global_batch") else
            "the model's inputs" if known else
            "assumed: neither the model's inputs nor auto.global_batch declare one")


def _found(candidate: Candidate) -> Dict[str, Any]:
    """How the search went, how the stages were cut, how the sharding was found."""
    record, found = candidate.search, {}
    if record is not None:
        planned = len(record.meshes) - len(record.unsearched) - len(record.pruned)
        found["search"] = {"meshes": len(record.meshes), "planned": planned,
                           "not_searched": [list(m) for m in record.unsearched],
                           "left_out": [list(m) for m in record.pruned],
                           "time_limit_s": record.time_limit_s, "seconds": record.seconds}
    if candidate.stage_search is not None:
        found["stage_search"] = candidate.stage_search.to_dict()
    if candidate.sharding_search is not None:
        found["sharding_search"] = candidate.sharding_search.to_dict()
    return found


def say_how_it_was_found(graph, rt, best: Candidate, runnable: Optional[Candidate],
                         candidates: Sequence[Candidate]) -> None:
    """Fallbacks of ``graph``'s plan: the search stopped at its time limit;
    the chosen plans' stages or sharding decided by a time limit. Advice: a
    plan with memory techniques the config does not list would be at least
    ``HINT_SPEED_UP`` times faster."""
    limit = rt.config.get("auto.search_time_limit_s")
    record = best.search
    if record is not None and record.unsearched:
        fallback.fall_back(
            f"auto.auto_parallel searches {len(record.meshes)} meshes",
            f"the search stopped at auto.search_time_limit_s ({limit:g} s) with "
            f"{len(record.unsearched)} of them not searched ({meshes_named(record.unsearched)}) "
            "and chose among the others",
            f"{_MORE}, or fix auto.num_task_graph to search fewer meshes", graph)
    for chosen in {id(c): c for c in (best, runnable) if c is not None}.values():
        what = f"auto.auto_parallel's plan ({chosen.describe()})"
        if chosen.stage_search is not None:
            say_stage_cut(graph, chosen.stage_search, what, limit)
        if chosen.sharding_search is not None and chosen.sharding_search.timed_out:
            fallback.fall_back(
                f"{what} shards its layers by Rhino's sharding search",
                f"its sharding is {chosen.sharding_search.describe()}",
                f"{_MORE}: each of its ILP solves gets 1/{round(1 / SOLVE_SHARE)} of it", graph)
    hint = faster_with_techniques(candidates, best)
    if hint is not None:
        speed_up, what, names = hint
        fallback.advise(f"tfpar: a plan with memory techniques auto.memory_techniques does "
                        f"not list would be {speed_up:.1f}x faster than the chosen one "
                        f"({best.describe()}): {what}. Add {', '.join(map(repr, names))} to "
                        "auto.memory_techniques to let the search choose it", graph)


def say_stage_cut(graph, outcome: Outcome, what: str, limit: float) -> None:
    """A fallback of ``graph``'s plan when a time limit decided the stage
    cut of ``what`` (the ILP's solution not proved optimal, or the balanced
    cut when it found none in time)."""
    if outcome.timed_out:
        fallback.fall_back(
            f"{what} cuts its pipeline stages by Rhino's stage ILP",
            f"the cut is {outcome.describe()}",
            f"{_MORE} ({limit:g} s): the stage ILP gets 1/{round(1 / STAGE_ILP_SHARE)} of it",
            graph)
