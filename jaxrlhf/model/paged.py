"""A paged KV cache with per-row positions (docs/rollout.md, "Paged KV cache").

Keys and values live in a fixed pool of pages of ``page_size`` slots each.  Every row has a
page table (its pages in slot order) and a length (its next write slot): a row's real tokens
sit at slots ``[0, length)`` end to end, whatever the other rows do, so rows advance on their
own (no lock step, no holes) and hold only the pages their tokens fill.  Free pages are a
stack inside the state; taking and returning them are pure functions, so the whole
bookkeeping runs inside a jitted loop with static shapes.

Invariants (tested in tests/test_paged.py): a page is on the free stack or in exactly one row's
table, never both and never twice; a row's table holds ``ceil(length / page_size)`` pages
(more only between :meth:`PagedKV.reserve` and the write that fills them).  Running out is not
silent: :meth:`PagedKV.reserve` grants a row all the pages it asked for or none, and says
which rows it could not serve, so the caller defers them or stops with an error.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxrlhf.config import ModelConfig
from jaxrlhf.mesh import ACT_RULES, constrain, logical_to_spec
from kernels._sharding import per_shard_manual


@flax.struct.dataclass
class PagedKV:
  """Pools ``k``/``v``: per-layer tuples of ``[K, pages, page_size, Dh]`` (or stacked
  ``[L, K, pages, page_size, Dh]``; head-major, as the attention's matmuls batch);
  ``table_RM``: each row's page ids in slot order, ``pages`` (one past the last id) where
  none; ``length_R``: each row's slots written; ``free_F``: the free stack (its first
  ``n_free`` entries are the free pages)."""

  k: object
  v: object
  table_RM: jax.Array  # int32 [R, M]
  length_R: jax.Array  # int32 [R]
  free_F: jax.Array  # int32 [pages]
  n_free: jax.Array  # int32 []
  page_size: int = flax.struct.field(pytree_node=False, default=16)
  # Row r holds pages r*M .. r*M + M - 1, in order, for good (the table is the identity; the
  # caller reserved every row's M pages up front): attention reads the pool as
  # [K, rows, M * page_size, Dh] as it lies, with no gather (:meth:`contiguous_view`).
  contiguous: bool = flax.struct.field(pytree_node=False, default=False)

  def contiguous_view(self) -> "PagedKV":
    """This cache marked :attr:`contiguous`: call it on a fresh cache right after reserving
    every row's ``M`` pages in one :meth:`reserve` (rows are served in order from the bottom
    of the pool, so row r gets pages r*M .. r*M + M - 1).  The pool must hold exactly those
    pages: its readers and writers take row ``r``'s slots from ``pages / rows`` pages."""
    if self.num_pages != self.rows * self.max_pages:
      raise ValueError(f"contiguous_view: {self.num_pages} pages for {self.rows} rows of "
                       f"{self.max_pages}; a contiguous pool holds exactly rows x pages a row")
    return self.replace(contiguous=True)

  @property
  def per_layer(self) -> bool:
    return isinstance(self.k, tuple)

  @property
  def num_pages(self) -> int:
    return self.free_F.shape[0]

  @property
  def rows(self) -> int:
    return self.table_RM.shape[0]

  @property
  def max_pages(self) -> int:
    """Pages a row may hold (``M``): its slot limit is ``M * page_size``."""
    return self.table_RM.shape[1]

  def held_R(self) -> jax.Array:
    """Pages in each row's table."""
    return jnp.sum(self.table_RM < self.num_pages, axis=1, dtype=jnp.int32)

  def in_use(self) -> jax.Array:
    """Pages held by rows (``pages - n_free``)."""
    return self.num_pages - self.n_free

  def reserve(self, need_R: jax.Array) -> tuple["PagedKV", jax.Array]:
    """Pages for ``need_R`` more slots of each row (past its length), from the free stack.

    A row gets every page it lacks or none: rows are served in order while the free pages
    last (the first row that does not fit, and every row after it that lacks a page, gets
    none: no part-served row, and no row served out of turn).  Returns ``(cache, ok_R)``:
    ``ok_R`` is true where the row now has room for its ``need_R`` slots (always where it
    needed no new page).  Rows past their ``M`` pages are never ok.  A :attr:`contiguous`
    cache holds every row's pages already: nothing to do."""
    ps, m, pages = self.page_size, self.max_pages, self.num_pages
    if self.contiguous:
      return self, self.length_R + need_R <= m * ps
    held = self.held_R()
    want = -(-(self.length_R + need_R) // ps)  # pages the row must hold
    lack = jnp.maximum(want - held, 0)
    fits = want <= m
    # Serve in row order while the pages last (a prefix sum: no sequential loop over rows).
    asked = jnp.where(fits, lack, 0)
    take_R = fits & (jnp.cumsum(asked) <= self.n_free)
    got = jnp.where(take_R, lack, 0)
    rank_R = jnp.cumsum(got) - got  # each served row's first rank on the stack
    # Pages are popped from the top of the stack: rank k takes free_F[n_free - 1 - k].
    j = jnp.arange(m, dtype=jnp.int32)
    valid_RM = j[None, :] < got[:, None]
    rank_RM = rank_R[:, None] + j[None, :]
    page_RM = self.free_F[jnp.clip(self.n_free - 1 - rank_RM, 0, pages - 1)]
    col_RM = jnp.where(valid_RM, held[:, None] + j[None, :], m)  # m: out of range, dropped
    row_RM = jnp.broadcast_to(jnp.arange(self.rows)[:, None], col_RM.shape)
    table = self.table_RM.at[row_RM, col_RM].set(page_RM, mode="drop")
    total = jnp.sum(got, dtype=jnp.int32)
    ok = fits & ((lack == 0) | take_R)
    return self.replace(table_RM=table, n_free=self.n_free - total), ok

  def release(self, rows_R: jax.Array) -> "PagedKV":
    """Every page of the rows ``rows_R`` (bool) back on the free stack; those rows empty."""
    pages = self.num_pages
    mine_RM = rows_R[:, None] & (self.table_RM < pages)
    flat = mine_RM.reshape(-1)
    rank = jnp.cumsum(flat.astype(jnp.int32)) - flat
    at = jnp.where(flat, self.n_free + rank, pages)  # pages: out of range, dropped
    free = self.free_F.at[at].set(self.table_RM.reshape(-1), mode="drop")
    table = jnp.where(rows_R[:, None], pages, self.table_RM)
    return self.replace(table_RM=table, free_F=free,
                        n_free=self.n_free + jnp.sum(flat, dtype=jnp.int32),
                        length_R=jnp.where(rows_R, 0, self.length_R))

  def slots(self, mask_RT: jax.Array) -> jax.Array:
    """The logical slot each real token of a ``[R, T]`` block is written at (each row's real
    tokens, in order, from its length on); -1 where ``mask_RT`` is false."""
    mask = mask_RT.astype(bool)
    at = self.length_R[:, None] + jnp.cumsum(mask, axis=1, dtype=jnp.int32) - 1
    return jnp.where(mask, at, -1)


def init_paged(cfg: ModelConfig, rows: int, num_pages: int, page_size: int, max_len: int,
               per_layer: bool, reserved: bool = False) -> PagedKV:
  """An empty paged cache of ``num_pages`` pages for ``rows`` rows of up to ``max_len``
  slots each, every page free; ``reserved``: every row's pages taken now, in order
  (``num_pages`` must hold them all), so the pool is read as it lies
  (:attr:`PagedKV.contiguous`)."""
  shape = (cfg.n_kv_heads, num_pages, page_size, cfg.head_dim)
  dtype = jnp.dtype(cfg.compute_dtype)
  if per_layer:
    k = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers))
    v = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers))
  else:
    k = jnp.zeros((cfg.n_layers,) + shape, dtype)
    v = jnp.zeros((cfg.n_layers,) + shape, dtype)
  m = -(-max_len // page_size)
  # The stack's top is its last entry: page 0 is taken first.
  cache = PagedKV(k=k, v=v, table_RM=jnp.full((rows, m), num_pages, jnp.int32),
                  length_R=jnp.zeros((rows,), jnp.int32),
                  free_F=jnp.arange(num_pages - 1, -1, -1, dtype=jnp.int32),
                  n_free=jnp.asarray(num_pages, jnp.int32), page_size=page_size)
  if not reserved:
    return cache
  if num_pages < rows * m:
    raise ValueError(f"init_paged: {num_pages} pages cannot hold {rows} rows of {m} pages")
  return cache.reserve(jnp.full((rows,), m * page_size, jnp.int32))[0].contiguous_view()


def pool_axes(per_layer: bool):
  """The pools' logical axes: pages are not a batch axis (any row may hold any page), so a
  pool is sharded over ``tp`` by kv head only, whole on every data shard; a
  :attr:`PagedKV.contiguous` pool is also split over the data axes (:func:`constrain_paged`)."""
  ax = ("kv_heads", None, None, "head_dim")
  return ax if per_layer else ("layers",) + ax


def rows_split(rows: int):
  """The mesh axes ``rows`` rows are split over in the mesh in context (the data axes that
  divide them, :data:`jaxrlhf.mesh.ACT_RULES`' "batch"), None when they are whole on every
  device (no mesh, one data shard)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return None
  return logical_to_spec(("batch",), ACT_RULES, (rows,), mesh)[0]


def constrain_paged(cache: PagedKV) -> PagedKV:
  """The pools' sharding.  A :attr:`PagedKV.contiguous` pool (row ``r``'s pages are
  ``r*M .. r*M + M - 1``, as many pages as rows hold) is split over the data axes as its rows
  are: each data shard holds its own rows' pages, and reads and writes them in place
  (:func:`write_layer`, :func:`kernels.attention.paged.row_slots`).  Any other pool is whole
  on every data shard: a row may hold any page."""
  axes = pool_axes(cache.per_layer)
  rows = rows_split(cache.rows) if cache.contiguous else None
  if rows is None:
    put = lambda x: constrain(x, axes)  # noqa: E731
  else:
    mesh = jax.sharding.get_abstract_mesh()
    shape = (cache.k[0] if cache.per_layer else cache.k).shape
    spec = list(logical_to_spec(axes, ACT_RULES, shape, mesh))
    spec[-3] = rows  # the pages axis, split as the rows are
    put = lambda x: jax.lax.with_sharding_constraint(x, PartitionSpec(*spec))  # noqa: E731
  if cache.per_layer:
    k = tuple(put(x) for x in cache.k)
    v = tuple(put(x) for x in cache.v)
  else:
    k, v = put(cache.k), put(cache.v)
  return cache.replace(k=k, v=v)


def write_layer(k_pool, v_pool, table_RM, slot_RT, k_RTKD, v_RTKD, li=None, *,
                contiguous: bool = False):
  """Writes a block's keys/values (``[R, T, K, Dh]``) at their logical slots (``slot_RT``,
  -1: not written) through the page table; ``li``: the layer of a stacked pool.
  ``contiguous``: the pool is a :attr:`PagedKV.contiguous` one (row ``r``'s pages in order
  from ``r * M``, all ``R`` rows written); when it is split over the data axes
  (:func:`constrain_paged`) each row's slots are written as a write batched over the rows,
  which the partitioner runs shard by shard (the table's scatter would gather every row's
  keys onto every device)."""
  pages, ps = k_pool.shape[-3], k_pool.shape[-2]
  # (Whole on every device, the table's scatter below writes the same slots in place; the
  # rows' batched write is only for a pool split over the data axes.)
  if contiguous and rows_split(k_RTKD.shape[0]) is not None:
    return tuple(_write_rows(pool, slot_RT, x, li) for pool, x in ((k_pool, k_RTKD),
                                                                    (v_pool, v_RTKD)))
  m = table_RM.shape[1]
  page_RT = jnp.take_along_axis(table_RM, jnp.clip(slot_RT // ps, 0, m - 1), axis=1)
  page_RT = jnp.where(slot_RT >= 0, page_RT, pages)  # out of range: dropped
  off_RT = jnp.maximum(slot_RT, 0) % ps
  if li is None:  # [K, pages, page, Dh]: the indexed axes adjacent, the update [K, R, T, Dh]
    put = lambda pool, x: pool.at[:, page_RT, off_RT, :].set(  # noqa: E731
        x.transpose(2, 0, 1, 3).astype(pool.dtype), mode="drop")
  else:  # [L, K, pages, page, Dh]: indexed axes apart, the update [R, T, K, Dh]
    put = lambda pool, x: pool.at[li, :, page_RT, off_RT, :].set(  # noqa: E731
        x.astype(pool.dtype), mode="drop")
  return put(k_pool, k_RTKD), put(v_pool, v_RTKD)


def _write_rows(pool, slot_RT, x_RTKD, li):
  """A contiguous pool's write: the pool seen as ``[.., K, R, M * page, Dh]`` (each row's
  slots in order), each row's block written at its slots (-1: dropped), under a mesh as a
  ``shard_map`` over the rows' data shards (each device writes its own rows into its own
  part of the pool)."""
  rows = x_RTKD.shape[0]
  *lead, k_heads, pages, ps, d = pool.shape
  view = pool.reshape(*lead, k_heads, rows, pages // rows * ps, d)
  at_RT = jnp.where(slot_RT >= 0, slot_RT, view.shape[-2])  # out of range: dropped
  x = x_RTKD.astype(pool.dtype)
  if li is None:
    out = _ROW_WRITE(view, at_RT, x)
  else:
    out = _ROW_WRITE_STACKED(jnp.reshape(jnp.asarray(li, jnp.int32), (1,)), view, at_RT, x)
  return out.reshape(pool.shape)


def _row_write(view_KBSD, at_BT, x_BTKD):
  r = jnp.arange(view_KBSD.shape[1])[:, None]
  return view_KBSD.at[:, r, at_BT, :].set(x_BTKD.transpose(2, 0, 1, 3), mode="drop")


def _row_write_stacked(li, view_LKBSD, at_BT, x_BTKD):
  r = jnp.arange(view_LKBSD.shape[2])[:, None]
  return view_LKBSD.at[li[0], :, r, at_BT, :].set(x_BTKD, mode="drop")


_ROW_WRITE = per_shard_manual(_row_write, "k b s d, b t, b t k d -> k b s d")
_ROW_WRITE_STACKED = per_shard_manual(_row_write_stacked,
                                      "x, l k b s d, b t, b t k d -> l k b s d")
