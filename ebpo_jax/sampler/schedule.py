"""Which rows hold which slots and pages, in one data shard: admission, growth, release.

Rows wait in row order. A free slot takes the next waiting row when the pool has its pages:
its prompt's full pages (copied from the prefill once, shared by the prompt's live samples)
and one page of its own (a copy of the prompt's partial page, or a fresh one). A live row
always holds the page its next token is written to; when a row crosses into a new page and
the pool is short, the most recently admitted rows are preempted (pages freed, row sent back
to wait) until it fits. A preempted row later restarts from its first token: its keys are
fold_in(rng, row, token), so it draws the same tokens again and the output does not change.
The oldest live row is never preempted, so every row ends (the engine checks up front that
one row's pages fit the pool).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ebpo_jax.sampler import pages

PENDING, RUNNING, DONE = 0, 1, 2


class Rows(NamedTuple):
    """Per-shard constants: rows [R] (local prompt, prompt length, token 0, limit), prompts [Q]."""

    prompt_R: jax.Array
    plen_R: jax.Array
    first_R: jax.Array
    limit_R: jax.Array
    full_Q: jax.Array  # the prompt's full pages (length // page_size)


class Slots(NamedTuple):
    """One shard's slots [S], row states [R], prompt pages [Q, W] and free pages [P]."""

    row_S: jax.Array  # the row the slot holds (stale once it ends)
    live_S: jax.Array
    t_S: jax.Array  # index of the token the next step samples
    prev_S: jax.Array  # token t - 1, fed in at the next step
    plen_S: jax.Array
    limit_S: jax.Array
    prompt_S: jax.Array
    stamp_S: jax.Array  # admission order: the largest is preempted first
    shared_S: jax.Array  # leading page-table columns that are the prompt's shared pages
    npages_S: jax.Array  # page-table columns held
    table_SM: jax.Array  # page ids; column i holds tokens [i * page_size, (i+1) * page_size)
    status_R: jax.Array  # PENDING, RUNNING or DONE
    users_Q: jax.Array  # live rows on the prompt's shared pages
    ppages_QW: jax.Array  # the prompt's shared page ids
    free_P: jax.Array
    clock: jax.Array
    preempted: jax.Array  # rows preempted so far


class Copy(NamedTuple):
    """Pages an admission fills from the prompt pages: for each admitted candidate c."""

    prompt_C: jax.Array  # the candidate's prompt
    shared_CW: jax.Array  # new shared pages (page j := prompt page j), "none" where not new
    own_C: jax.Array  # its own page (:= prompt page partial_C), "none" if not admitted
    partial_C: jax.Array


def init(rows: Rows, eos_E, *, slots: int, width: int, max_pages: int, num_pages: int) -> Slots:
    """No row admitted yet; rows whose token 0 already ends them are done."""
    S, Q = slots, rows.full_Q.shape[0]
    z = jnp.zeros((S,), jnp.int32)
    ends_R = jnp.isin(rows.first_R, eos_E) | (rows.limit_R <= 1)
    return Slots(
        row_S=z, live_S=z.astype(bool), t_S=z + 1, prev_S=z, plen_S=z + 1, limit_S=z,
        prompt_S=z, stamp_S=z, shared_S=z, npages_S=z,
        table_SM=jnp.full((S, max_pages), num_pages, jnp.int32),
        status_R=jnp.where(ends_R, DONE, PENDING).astype(jnp.int32),
        users_Q=jnp.zeros((Q,), jnp.int32),
        ppages_QW=jnp.full((Q, width), num_pages, jnp.int32),
        free_P=jnp.ones((num_pages,), bool), clock=jnp.int32(0), preempted=jnp.int32(0),
    )  # fmt: skip


def kv_len(st: Slots):
    """Tokens in each slot's cache before its next step (prompt + tokens fed so far)."""
    return st.plen_S + st.t_S - 1


def release(st: Slots, rows: Rows, end_S) -> Slots:
    """Frees the own pages of slots end_S, and a prompt's shared pages with its last user."""
    M = st.table_SM.shape[1]
    col_M = jnp.arange(M)[None]
    own_SM = end_S[:, None] & (col_M >= st.shared_S[:, None]) & (col_M < st.npages_S[:, None])
    free_P = pages.give_back(st.free_P, st.table_SM, own_SM)
    users_Q = st.users_Q.at[st.prompt_S].add(-end_S.astype(jnp.int32))
    gone_Q = (users_Q == 0) & (st.users_Q > 0)
    W = st.ppages_QW.shape[1]
    shared_QW = gone_Q[:, None] & (jnp.arange(W)[None] < rows.full_Q[:, None])
    free_P = pages.give_back(free_P, st.ppages_QW, shared_QW)
    return st._replace(live_S=st.live_S & ~end_S, users_Q=users_Q, free_P=free_P)


def _growing(st: Slots, page_size: int):
    """Live slots whose next token starts a new page."""
    return st.live_S & (kv_len(st) % page_size == 0) & (kv_len(st) // page_size >= st.npages_S)


def _preempt_youngest(st: Slots, rows: Rows) -> Slots:
    s = jnp.argmax(jnp.where(st.live_S, st.stamp_S, -1))
    st = release(st, rows, jnp.arange(st.live_S.shape[0]) == s)
    return st._replace(
        status_R=st.status_R.at[st.row_S[s]].set(PENDING), preempted=st.preempted + 1
    )


def grow(st: Slots, rows: Rows, *, page_size: int) -> Slots:
    """Gives every live row the page of its next token, preempting the youngest if short."""

    def short(st):
        need = _growing(st, page_size).sum()
        return (need > st.free_P.sum()) & (st.live_S.sum() > 1)

    st = jax.lax.while_loop(short, lambda st: _preempt_youngest(st, rows), st)
    need_S = _growing(st, page_size)
    new_S1, free_P = pages.take(st.free_P, need_S.astype(jnp.int32), 1)
    S, M = st.table_SM.shape
    col_S = jnp.where(need_S, st.npages_S, M)
    table_SM = st.table_SM.at[jnp.arange(S), col_S].set(new_S1[:, 0], mode="drop")
    return st._replace(table_SM=table_SM, npages_S=st.npages_S + need_S, free_P=free_P)


def admit(st: Slots, rows: Rows, *, page_size: int, reserve: bool) -> tuple[Slots, Copy]:
    """Free slots take the next waiting rows, in row order, while the pool has their pages.

    reserve: a row takes every page it may need at once (a pool sized for every slot's
    longest row: rows then never grow, wait or preempt), else the page of its next token.
    """
    S, M = st.table_SM.shape
    R, (Q, W) = st.status_R.shape[0], st.ppages_QW.shape
    c_C = jnp.arange(S)
    cand_C = jnp.nonzero(st.status_R == PENDING, size=S, fill_value=R)[0]
    r_C = jnp.minimum(cand_C, R - 1)
    q_C, plen_C = rows.prompt_R[r_C], rows.plen_R[r_C]
    full_C = plen_C // page_size
    # A prompt's waiting samples are consecutive candidates: the first one copies its pages.
    new_prompt_C = (st.users_Q[q_C] == 0) & ((c_C == 0) | (q_C != jnp.roll(q_C, 1)))
    own_C = M - full_C if reserve else jnp.ones_like(full_C)
    need_C = jnp.where(new_prompt_C, full_C, 0) + own_C
    # Growing rows are what preempts: keep a spare page for each row admitted before c.
    spare_C = 0 if reserve else st.live_S.sum() + c_C
    fits_C = jnp.cumsum(need_C) + spare_C <= st.free_P.sum()
    admit_C = (cand_C < R) & (c_C < (~st.live_S).sum()) & fits_C
    shared_CW, free_P = pages.take(st.free_P, jnp.where(admit_C & new_prompt_C, full_C, 0), W)
    own_C = jnp.where(admit_C, own_C, 0)
    own_CM, free_P = pages.take(free_P, own_C, M)
    fresh_C = admit_C & new_prompt_C
    ppages_QW = st.ppages_QW.at[jnp.where(fresh_C, q_C, Q)].set(shared_CW, mode="drop")
    col_M = jnp.arange(M)[None]
    prompt_CM = jnp.pad(ppages_QW, ((0, 0), (0, M - W)), constant_values=free_P.shape[0])[q_C]
    own_at_CM = jnp.take_along_axis(own_CM, jnp.clip(col_M - full_C[:, None], 0, M - 1), 1)
    table_CM = jnp.where(col_M < full_C[:, None], prompt_CM, own_at_CM)
    slot_C = jnp.nonzero(~st.live_S, size=S, fill_value=S)[0]
    s_C = jnp.where(admit_C, slot_C, S)
    put = lambda x, v: x.at[s_C].set(v, mode="drop")
    st = st._replace(
        row_S=put(st.row_S, cand_C), live_S=put(st.live_S, True), t_S=put(st.t_S, 1),
        prev_S=put(st.prev_S, rows.first_R[r_C]), plen_S=put(st.plen_S, plen_C),
        limit_S=put(st.limit_S, rows.limit_R[r_C]), prompt_S=put(st.prompt_S, q_C),
        stamp_S=put(st.stamp_S, st.clock + c_C), shared_S=put(st.shared_S, full_C),
        npages_S=put(st.npages_S, full_C + own_C), table_SM=put(st.table_SM, table_CM),
        status_R=st.status_R.at[jnp.where(admit_C, cand_C, R)].set(RUNNING, mode="drop"),
        users_Q=st.users_Q.at[q_C].add(admit_C.astype(jnp.int32)),
        ppages_QW=ppages_QW, free_P=free_P, clock=st.clock + admit_C.sum(dtype=jnp.int32),
    )  # fmt: skip
    return st, Copy(q_C, shared_CW, own_CM[:, 0], full_C)
