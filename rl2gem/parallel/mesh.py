"""The device mesh every trainer runs on, built from named dims.

``world = replicate * shard * sp * tp``:

* ``replicate``: HSDP replicas (DDP across groups; RL2's ``ddp_size``);
* ``shard``: FSDP2 sharding inside a replica group (ZeRO-3);
* ``sp``: sequence (context) parallel ranks of one sequence (ring attention);
* ``tp``: tensor parallel ranks of one layer.

Data-parallel ranks (who gets which sequences) are the ``replicate x shard`` coordinates;
ranks that differ only in ``sp`` / ``tp`` see the same data. Trainers ask the mesh for
``data_mesh`` (what FSDP shards over), ``dp_rank`` and ``dp_size`` and never build meshes
themselves, so a new dim changes this module and the model workers, not the trainers.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

__all__ = ["MESH_DIMS", "ParallelMesh", "build_mesh"]

MESH_DIMS = ("replicate", "shard", "sp", "tp")


@dataclasses.dataclass
class ParallelMesh:
    """A ``torch.distributed.DeviceMesh`` over :data:`MESH_DIMS` and what trainers read from it.

    Attributes:
        mesh: the 4-D mesh (dims of size 1 included).
        sizes: ``{dim: size}``.
    """

    mesh: object
    sizes: dict[str, int]

    @property
    def data_mesh(self):
        """The mesh FSDP2 shards over: 1-D ``("shard",)``, or 2-D ``("replicate", "shard")`` for HSDP."""
        if self.sizes["replicate"] == 1:
            return self.mesh["shard"]
        return self.mesh["replicate", "shard"]

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: ``replicate * shard``."""
        return self.sizes["replicate"] * self.sizes["shard"]

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index in ``[0, dp_size)``."""
        coordinate = dict(zip(MESH_DIMS, self.mesh.get_coordinate(), strict=True))
        return coordinate["replicate"] * self.sizes["shard"] + coordinate["shard"]


def build_mesh(ddp_size: int = 1, tp_size: int = 1, sp_size: int = 1) -> ParallelMesh:
    """The mesh of the current process group: ``shard = world / (ddp_size * sp_size * tp_size)``.

    Raises:
        ValueError: a size below 1, a world size the sizes do not divide (naming the config keys),
            or ``tp_size`` / ``sp_size`` above 1 (not implemented yet).
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    for key, value in (("actor.ddp_size", ddp_size), ("actor.tp_size", tp_size), ("actor.sp_size", sp_size)):
        if int(value) < 1:
            raise ValueError(f"{key}={value} must be >= 1")
    if tp_size > 1 or sp_size > 1:
        raise ValueError(
            f"actor.tp_size={tp_size} / actor.sp_size={sp_size}: tensor and sequence parallelism are "
            "not implemented yet; use 1"
        )
    inner = ddp_size * sp_size * tp_size
    if world % inner:
        raise ValueError(
            f"the world size {world} is not a multiple of actor.ddp_size * actor.sp_size * actor.tp_size "
            f"= {ddp_size} * {sp_size} * {tp_size}"
        )
    sizes = {"replicate": int(ddp_size), "shard": world // inner, "sp": int(sp_size), "tp": int(tp_size)}
    kind = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(kind, tuple(sizes[d] for d in MESH_DIMS), mesh_dim_names=MESH_DIMS)
    return ParallelMesh(mesh, sizes)
