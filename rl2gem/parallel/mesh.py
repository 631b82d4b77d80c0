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

FSDP shards parameters over ``shard x sp`` (flattened): the ``sp`` ranks of a sequence hold the
same parameters and each computes gradients from its part of the tokens, so they reduce their
gradients like data-parallel ranks (see :func:`rl2gem.parallel.ring_attention.gather_sequence_parallel`
for why the average over them is right). The ``tp`` dim holds DTensor shards of each layer
(:mod:`rl2gem.parallel.tensor_parallel`); FSDP composes with it (2-D FSDP x TP).

Length rule (RL2's): a micro-batch holds at most ``sp_size * tp_size * max_length_per_device``
tokens (:meth:`ParallelMesh.micro_batch_tokens`), and so does the longest sequence.
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
    _data_mesh: object = None

    @property
    def sp_size(self) -> int:
        return self.sizes["sp"]

    @property
    def tp_size(self) -> int:
        return self.sizes["tp"]

    @property
    def sp_group(self):
        """The process group of this rank's sequence-parallel ranks (None when ``sp == 1``)."""
        return self.mesh["sp"].get_group() if self.sizes["sp"] > 1 else None

    @property
    def tp_mesh(self):
        """The 1-D mesh of this rank's tensor-parallel ranks (None when ``tp == 1``)."""
        return self.mesh["tp"] if self.sizes["tp"] > 1 else None

    def micro_batch_tokens(self, max_length_per_device: int) -> int:
        """Tokens one micro-batch (and one sequence) may hold: ``sp * tp * max_length_per_device``
        (each rank then holds at most ``max_length_per_device`` of them, or their activations'
        ``1 / tp`` share)."""
        return int(max_length_per_device) * self.sizes["sp"] * self.sizes["tp"]

    @property
    def data_mesh(self):
        """The mesh FSDP2 shards over: 1-D ``("shard",)`` (``shard x sp`` flattened when ``sp > 1``),
        or 2-D with ``"replicate"`` in front for HSDP."""
        if self._data_mesh is None:
            if self.sizes["sp"] == 1:
                dims = ("shard",) if self.sizes["replicate"] == 1 else ("replicate", "shard")
                self._data_mesh = self.mesh[dims]
            elif self.sizes["replicate"] == 1:
                self._data_mesh = self.mesh["shard", "sp"]._flatten("shard_sp")
            else:
                self.mesh["shard", "sp"]._flatten("shard_sp")
                self._data_mesh = self.mesh["replicate", "shard_sp"]
        return self._data_mesh

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
        ValueError: a size below 1 or a world size the sizes do not divide (naming the config keys).
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    for key, value in (("actor.ddp_size", ddp_size), ("actor.tp_size", tp_size), ("actor.sp_size", sp_size)):
        if int(value) < 1:
            raise ValueError(f"{key}={value} must be >= 1")
    inner = ddp_size * sp_size * tp_size
    if world % inner:
        raise ValueError(
            f"the world size {world} is not a multiple of actor.ddp_size * actor.sp_size * actor.tp_size "
            f"= {ddp_size} * {sp_size} * {tp_size}"
        )
    sizes = {"replicate": int(ddp_size), "shard": world // inner, "sp": int(sp_size), "tp": int(tp_size)}
    kind = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    mesh = init_device_mesh(kind, tuple(sizes[d] for d in MESH_DIMS), mesh_dim_names=MESH_DIMS)
    return ParallelMesh(mesh, sizes)
