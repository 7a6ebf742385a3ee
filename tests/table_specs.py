"""The ``TableSpec`` the search tests build their small problems from (one builder, not a copy
per test file)."""

from torchrec_sparselift.semantics.tables import TableSpec

TYPES = ("table_wise", "column_wise", "row_wise", "table_row_wise", "data_parallel")


def table_spec(i, rows, dim, pf, types=TYPES, *, pooled=True, batch_size=512):
    """Table ``t{i}`` read by feature ``f{i}``: ``rows`` x ``dim`` fp32, pooling factor ``pf``,
    offered ``types`` (data-parallel with the dense kernel, the others fused)."""
    return TableSpec(
        module_path="m", name=f"t{i}", num_embeddings=rows, embedding_dim=dim,
        feature_names=(f"f{i}",), pooling_factor=pf, is_pooled=pooled, elem_bytes=4,
        sharding_types=types,
        compute_kernels=tuple((t, ("dense",) if t == "data_parallel" else ("fused",)) for t in types),
        batch_size=batch_size,
    )
