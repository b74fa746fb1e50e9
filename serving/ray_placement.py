"""Where a Serve replica runs: its Ray resources when `ray_actor_options` names none, and, for
`tensor_parallel > 1`, the devices of its placement group's bundles (one per rank; the replica runs rank 0
in the first and starts the other ranks on the rest).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

BUNDLE_DISCOVERY_TIMEOUT_S = 120.0
"""Seconds a tensor-parallel replica waits to learn its rank bundles' GPU ids before failing."""


def placement_group_gpu_ids(bundles: Sequence[Mapping[str, float]], own_gpu_ids: Sequence[str],
                            other_bundle_gpu_ids: Callable[[list[tuple[int, float]]], list[list[str]]]) -> list[str]:
    """The GPU ids of a tensor-parallel replica's ranks, in rank order (bundle i holds rank i's GPUs).

    `bundles` are the placement group's bundle specs, `own_gpu_ids` the GPUs Ray assigned the replica
    actor itself, and `other_bundle_gpu_ids([(index, gpus), ...])` returns the GPU ids of each of those
    other bundles. Bundle 0 is never asked about: Serve schedules the replica actor in it, so its GPUs
    are the actor's own, and a task asking Ray for them would wait for the actor to release them
    (forever). Bundles 1.. are reserved for this replica's ranks and held by nothing, so a task placed
    in each can take its GPUs for a moment and read their ids. An empty list: a CPU placement group.
    """
    if not any(bundle.get("GPU") for bundle in bundles):
        return []
    if bundles[0].get("GPU") and not own_gpu_ids:
        raise ValueError(f"the replica holds no GPU although its placement group's bundle 0 has "
                         f"{bundles[0]['GPU']:g}: give ray_actor_options the GPUs of one rank (num_gpus)")
    others = [(index, float(bundle.get("GPU", 0))) for index, bundle in enumerate(bundles) if index > 0]
    ids = list(own_gpu_ids)
    for (index, gpus), found in zip(others, other_bundle_gpu_ids(others), strict=True):
        if gpus and not found:
            raise RuntimeError(f"Ray assigned no GPU to placement-group bundle {index} ({gpus:g} reserved)")
        ids += found
    return ids


def use_placement_group_devices(tensor_parallel: int | None) -> None:
    """Let this replica's ranks see every GPU of its placement group's bundles.

    Ray shows an actor only its own bundle's GPU (CUDA_VISIBLE_DEVICES); the other ranks are this
    replica's child processes, so before CUDA starts the variable is widened to the GPUs of all the
    bundles, rank order (`placement_group_gpu_ids`). A CPU placement group needs nothing.
    """
    if tensor_parallel is None or tensor_parallel <= 1:
        return
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = get_current_placement_group()
    if group is None:
        return

    @ray.remote(num_cpus=0)
    def gpu_ids() -> list[str]:
        return [str(i) for i in ray.get_runtime_context().get_accelerator_ids()["GPU"]]

    def other_bundle_gpu_ids(others: list[tuple[int, float]]) -> list[list[str]]:
        refs = [gpu_ids.options(num_gpus=gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=index)).remote() for index, gpus in others]
        try:
            # The bundles are reserved for this replica: the tasks start at once unless something
            # else took a bundle's GPU, which would otherwise block this replica forever.
            return ray.get(refs, timeout=BUNDLE_DISCOVERY_TIMEOUT_S)
        except GetTimeoutError:
            raise RuntimeError(f"could not read the GPU ids of placement-group bundles {[i for i, _ in others]} "
                               f"within {BUNDLE_DISCOVERY_TIMEOUT_S:g} s: is another actor or task holding "
                               "their GPUs?") from None

    own = [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]
    ids = placement_group_gpu_ids(group.bundle_specs, own, other_bundle_gpu_ids)
    if ids:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids)


def default_actor_resources(device: str | None, cluster_has_gpus: Callable[[], bool]) -> dict[str, int]:
    """One replica's (one rank's) Ray resources when `ray_actor_options` names none.

    A GPU when the engine runs on CUDA, else a CPU. `device` unset follows what the plan picks on the
    replica (CUDA when it sees a GPU): one GPU when `cluster_has_gpus()` (asked only then), else one
    CPU, so a GPU cluster serves on its GPUs without naming the device, and a replica always holds the
    device it uses (Ray hides the GPUs from an actor that reserved none).
    """
    if device is not None:
        gpu = str(device).startswith("cuda")
    else:
        gpu = cluster_has_gpus()
    return {"num_gpus": 1} if gpu else {"num_cpus": 1}


def cluster_has_gpus() -> bool:
    """Whether the replicas will find GPUs: the connected Ray cluster's resources, or, when this process
    is not connected yet (`serve run` builds the app before `ray.init`; `serve.run` starts a local
    cluster), this machine's."""
    import ray

    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    import torch

    return torch.cuda.is_available()
