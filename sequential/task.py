"""The sequential families' task (``recscale.train.task``): packs of histories in, a next-item
loss to train, ranking metrics to evaluate.

Every step reads ``P`` packs (``sequential.source``), sharded over the data-parallel devices:
the model and the loss are ``jax.vmap``-ed over the pack axis, so each device runs whole
histories and the batch-mean loss is the sum over packs of the losses' sums over their sum of
weights (each supervised token weighs the same, whatever pack it is in).

Lookups: a training step first draws every pack's negatives (ids only), then looks up all
the item ids it reads, ``[P, T_pad + T_pad + K]`` (the packs' tokens, their targets, the
negatives: ``K`` shared ones of the sampled softmax, ``T_pad`` of the BCE) in **one** call of the
item table, each id a bag of one (``SeqModel.item_embeddings``), and vmaps the model and the
loss over the packs with those rows. With the sharded engine (``embeddings.sharding`` other than
off) that is one all-to-all each way, and the gradients of the looked-up rows go to the engine's
sparse row update (SGD, row-wise Adagrad or lazy Adam, ``embedding_optim``), never a table
gradient; per-table, to the table's optax update. The full softmax scores every item: its
step's lookup appends ids ``0..V`` (the whole table, ``[V + 1, D]``), so the engine serves it
too, at the cost of moving the whole table through the all-to-all each way and updating every
row each step (its lazy Adam then is the per-table path's dense Adam); the sampled losses move
``P·(2·T_pad + K)`` rows.

Randomness: the step's key (split off ``TrainState.rng``, checkpointed) is split into a
negatives key and a dropout key, and each pack ``p`` folds in ``p``: pack ``p`` draws its own
sampled-softmax negatives (shared by its tokens) or BCE negatives, and its own dropout masks.

Evaluation (one forward per pack): the full-softmax next-item cross-entropy of every target of
the eval packs (``loss``, nats; with the training loss's temperature and normalisation, so a
softmax-trained model's is comparable with the planted data's ``bayes_loss``), the full ranking
of each history's held-out item (``hr@10``, ``ndcg@10``, ``hr@50``, ``ndcg@50``, ``mrr``,
``sequential.metrics.full_metrics``) and, with ``data.sampled_negatives``, SASRec's sampled
protocol (``sampled_hr@10``, ``sampled_ndcg@10``, ``sampled_mrr``). All are sums over packs and
batches, divided at the end (``sequential.metrics.finalize``). Every pack reads one copy of the
whole table, gathered once per step (``SeqModel.item_table``; the engine's by one lookup of ids
``0..V``, which serves every layout alike): exact ranks for every K (``metrics.rank_full``'s
chunked count), at ``[V + 1, D]`` on each device during evaluation. Scoring shard by shard and
summing each target's count of better items over the shards would bound that at a shard's rows
(exact too, unlike a top-K merge for K fixed in advance); not needed at the catalogue sizes here.

Cost: the train rows' ``tokens`` (real tokens per step) and ``tokens_x_len`` (the sum over those
tokens of their history's length) give the per-token cost ``cfg.model.cost(seq_len=...,
loss=cfg.loss)`` at the token-weighted history length (the cost is affine in it, so this is
exact for the whole batch): ``train_flops`` per step and ``flops_per_sec``, beside
``tokens_per_sec``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from recscale.config import ConfigError
from sequential import losses, metrics, serving
from sequential.layers import table_rows
from sequential.source import SequenceSource

FULL_KS = (10, 50)
SAMPLED_KS = (10,)


def _unsupported(cfg: Any) -> list[str]:
    """What the sequential families do not train with yet, each with the flag to change."""
    out = []
    e = cfg.embeddings
    for name, on, why in (
        ("tiers", e.tiers, "tiered tables fill their caches from CTR batches' ids"),
        ("measure_skew", e.measure_skew, "it counts CTR batches' ids"),
        ("calibrate", e.calibrate, "it times lookups at a CTR model's embed_dim"),
    ):
        if on:
            out.append(f"embeddings.{name}: {why}; leave it off")
    if cfg.embedding_optim.cowclip_ratio:
        out.append("embedding_optim.cowclip_ratio: CowClip counts CTR batches' ids; set it to 0")
    if cfg.train.noise_scale_every:
        out.append("train.noise_scale_every: the noise scale splits CTR batches; set it to 0")
    if cfg.train.early_stopping_metric:
        out.append("train.early_stopping_metric: auc / logloss are CTR metrics; leave it empty")
    return out


class _Sums:
    """Sums of the eval step's outputs over batches, finalised into means."""

    def __init__(self, reference: dict):
        self.sums: dict[str, float] = {}
        self.reference = reference

    def update(self, out: dict, batch: Any) -> None:
        del batch
        for k, v in jax.device_get(out).items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v)

    def result(self) -> dict:
        s = self.sums
        res = {"loss": s["loss_sum"] / max(s["weight"], 1.0), "targets": s["weight"]}
        res.update(metrics.finalize({k: v for k, v in s.items() if k in _FULL_KEYS}))
        sampled = {k.removeprefix("sampled_"): v for k, v in s.items() if k.startswith("sampled_")}
        if sampled:
            res.update({f"sampled_{k}": v for k, v in metrics.finalize(sampled).items()})
        res["num_examples"] = res.pop("count")
        return {**res, **self.reference}


_FULL_KEYS = {f"{m}@{k}" for m in ("hr", "ndcg") for k in FULL_KS} | {"mrr", "count"}


class SequentialTask:
    """The trainer's hooks of a ``sequential.run_config.SequentialConfig`` run."""

    def __init__(self, cfg: Any):
        self.cfg = cfg

    def check(self, cfg: Any) -> None:
        bad = _unsupported(cfg)
        if bad:
            raise ConfigError(f"{type(cfg).__name__}: unsupported settings: " + "; ".join(bad))

    def make_source(
        self,
        cfg: Any,
        *,
        process_index: int,
        process_count: int,
        eval_path: str | None,
        rejects_dir: str | None,
        eval_only: bool,
    ) -> SequenceSource:
        del rejects_dir
        if eval_path:
            raise ConfigError(
                "--data-path: a sequential run evaluates its own held-out users "
                "(data.eval_split), not another file"
            )
        return SequenceSource(
            cfg, process_index=process_index, process_count=process_count, eval_only=eval_only
        )

    def step_args(self, source: SequenceSource) -> dict[str, np.ndarray]:
        if self.cfg.loss.sampler != "popularity":
            return {}
        return {"item_log_q": source.item_log_q()}

    def loss(self, model: nnx.Module, batch: Any, key: Any, args: dict) -> tuple[Any, dict]:
        lcfg, n = self.cfg.loss, self.cfg.model.max_seq_len
        neg_key, drop_key = jax.random.split(key)
        log_q = args.get("item_log_q")
        packs, t = batch.values.shape
        pack_ids = jnp.arange(packs)

        def draw(pack, p):
            k = jax.random.fold_in(neg_key, p)
            return losses.draw_negatives(
                pack, k, lcfg, n_items=model.cfg.n_items, max_seq_len=n, item_log_q=log_q
            )

        neg = jax.vmap(draw)(batch, pack_ids)
        # Every row the step reads, in one lookup of the item table: the engine's one
        # all-to-all each way, and one sparse update that sees each row's gradient once.
        ids_pm = jnp.concatenate([batch.values, batch.targets, neg.ids], axis=1)
        flat = ids_pm.reshape(-1)
        if lcfg.kind == "full_softmax":  # every item is a negative: the table joins the lookup
            flat = jnp.concatenate([flat, jnp.arange(model.cfg.n_items + 1, dtype=jnp.int32)])
        rows = model.item_embeddings(flat)
        rows_pmd = rows[: ids_pm.size].reshape(*ids_pm.shape, -1)
        table_vd = rows[ids_pm.size :] if lcfg.kind == "full_softmax" else None

        def one(pack, rows_md, neg_p, p):
            user_td = model(
                pack.values,
                pack.offsets,
                dropout_key=jax.random.fold_in(drop_key, p),
                items_td=rows_md[:t],
            )
            sup = losses.supervision(pack, n)
            loss_sum, weight = losses.loss_sums(
                user_td,
                sup,
                lcfg,
                pos_td=rows_md[t : 2 * t],
                neg=neg_p,
                neg_rows=rows_md[2 * t :],
                table_vd=table_vd,
            )
            n_b = jnp.minimum(jnp.diff(pack.offsets), n).astype(jnp.float32)
            return loss_sum, weight, n_b.sum(), jnp.sum(n_b * n_b)

        loss_sum, weight, tokens, tokens_x_len = (
            x.sum() for x in jax.vmap(one)(batch, rows_pmd, neg, pack_ids)
        )
        out = {"tokens": tokens, "tokens_x_len": tokens_x_len, "targets": weight}
        return loss_sum / jnp.maximum(weight, 1.0), out

    def eval_step(self, graphdef: nnx.GraphDef) -> Any:
        lcfg, n = self.cfg.loss, self.cfg.model.max_seq_len
        full_loss = dataclasses.replace(lcfg, kind="full_softmax")
        # Only the last token of a sasrec or tabular pack has a target: scored alone, [B, V]
        # not [T, V].
        last_only = self.cfg.data.kind in ("sasrec", "tabular")

        def one(model, table_vd, pack, negatives):
            items_td = table_rows(table_vd, pack.values)
            user_td = model(pack.values, pack.offsets, items_td=items_td)
            if last_only:
                q = metrics.last_token_queries(pack, n)
                user_bd, tab_vd = user_td[q.index], table_vd
                if lcfg.l2_norm:
                    user_bd = losses.l2_normalize(user_bd, lcfg.l2_eps)
                    tab_vd = losses.l2_normalize(tab_vd, lcfg.l2_eps)
                loss_sum, weight = losses.full_softmax(
                    user_bd,
                    tab_vd,
                    q.target,
                    q.valid.astype(jnp.float32),
                    temperature=lcfg.temperature,
                )
                out = {"loss_sum": loss_sum, "weight": weight}
            else:
                _, out = losses.next_item_loss(
                    model, pack, None, full_loss, user_td=user_td, table_vd=table_vd
                )
            out = dict(out)
            out.update(
                metrics.full_metrics(
                    model,
                    pack,
                    ks=FULL_KS,
                    l2_norm=lcfg.l2_norm,
                    user_td=user_td,
                    table_vd=table_vd,
                )
            )
            if negatives is not None:
                sampled = metrics.sampled_metrics(
                    model,
                    pack,
                    negatives,
                    ks=SAMPLED_KS,
                    l2_norm=lcfg.l2_norm,
                    user_td=user_td,
                    table_vd=table_vd,
                )
                out.update({f"sampled_{k}": v for k, v in sampled.items()})
            return out

        def eval_step(params, batch_stats, batch) -> dict:
            model = nnx.merge(graphdef, params, batch_stats)
            # The table once for every pack (the engine's gathered by one lookup): the tokens'
            # rows, the full ranking and the candidates of the sampled protocol read it.
            table_vd = model.item_table()
            per_pack = jax.vmap(lambda pk, ng: one(model, table_vd, pk, ng))(
                batch.pack, batch.negatives
            )
            return {k: v.sum() for k, v in per_pack.items()}

        return eval_step

    def accumulator(self, source: SequenceSource) -> _Sums:
        return _Sums(dict(source.reference))

    def rates(self, row: dict, steps: int, seconds: float) -> dict:
        tokens = row.get("tokens")
        if not tokens:
            return {}
        seq_len = row["tokens_x_len"] / tokens
        per_token = self.cfg.model.cost(seq_len=seq_len, loss=self.cfg.loss).train_flops
        return {
            "tokens_per_sec": tokens * steps / seconds,
            "train_flops": tokens * per_token,
            "flops_per_sec": tokens * per_token * steps / seconds,
        }

    def eval_data(self, cfg: Any, data_path: str | None) -> str:
        del data_path
        d = cfg.data
        if d.kind == "tabular":
            return d.tabular.spec
        return d.sasrec_path if d.kind == "sasrec" else f"planted:{d.shuffle_seed}"

    def serving_parts(self, restored: Any, args: Any) -> Any:
        """The export's hook (``recscale.serving.export``): this run's next-item programs and
        manifest fields (``sequential.serving``)."""
        return serving.serving_parts(restored, args)

    def check_eval(self, args: Any) -> None:
        for flag in ("curvature", "comm_sensitivity", "embeddings_int8"):
            if getattr(args, flag):
                raise ConfigError(
                    f"--{flag.replace('_', '-')}: not supported for sequential families (it "
                    "reads CTR batches)"
                )
