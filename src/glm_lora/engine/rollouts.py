"""The RL stage's batches: answers sampled from the policy being trained, scored, turned into advantages.

`Rollouts` stands where the other stages' StageData stands (engine/fit.py calls `batches`): its batch stream
draws `rl.batch_size` prompts per step from the SFT split (optionally only `rl.families`), samples
`rl.group_size` answers to each with the current weights (evaluation/decode.sample_decode, KV cache, sampling
generator seeded by the prompt cursor: a stage resumed from a checkpoint draws the same answers), scores them
(engine/rewards.py) and yields one padded batch of prompt + answer rows with labels on the answers and each row's
group-normalised advantage. The position (`data_state`) is the prompt cursor, saved with every checkpoint.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from glm_lora.configs.errors import UserError
from glm_lora.configs.schema import Config, RLConfig
from glm_lora.data.packing import IGNORE
from glm_lora.data.prepare import split_path
from glm_lora.data.encode import cut_messages
from glm_lora.data.tokenizer import end_of_turn_ids, prompt_ids_many
from glm_lora.engine import dist, rewards as reward_fns
from glm_lora.evaluation import decode, metrics
from glm_lora.engine.trainer import Runtime

log = logging.getLogger("glm_lora.rl")

ADVANTAGE_EPS = 1e-4
SAMPLES_KEPT = 24        # sampled answers kept for the stage's UI table (the last steps')


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """(prompts, G) summed rewards → (r − group mean) / (group std + ε): GRPO's group-relative advantage (a group
    whose answers all score the same gets 0 everywhere: nothing to learn from it). The std is the sample std, ε
    1e-4, as TRL's GRPOTrainer computes them."""
    mean, std = rewards.mean(1, keepdim=True), rewards.std(1, keepdim=True)
    return (rewards - mean) / (std + ADVANTAGE_EPS)


def sampling_seed(seed: int, cursor: int, rank: int) -> int:
    """A rollout's sampling seed, from the stage's seed and the prompt cursor: a resumed stage draws the same answers."""
    return (seed * 1_000_003 + cursor) * 1_009 + rank


class Rollouts:
    def __init__(self, cfg: Config, tok, data_dir: Path | None, model, rt: Runtime, sampler=None, *,
                 rows: list[dict] | None = None, stop: list[int] | None = None):
        """`sampler`: engine/vllm_rollouts.VLLMSampler (rl.sampler vllm), else answers come from our own sampler.
        `rows` ({"prompt", "reference", "task", "ids"} each) and `stop` (the token ids an answer ends at) stand in
        for the SFT split's prompts and the chat template's end of turn where a caller brings its own (bench/rl_gpu.py:
        random token ids, answers of a fixed length)."""
        self.tc: RLConfig = cfg.rl
        self.tok, self.model, self.rt, self.sampler = tok, model, rt, sampler
        self.rewards = reward_fns.resolve(self.tc.rewards)
        self.stop = end_of_turn_ids(tok) if stop is None else list(stop)
        self.rows = self._prompts(cfg, data_dir) if rows is None else rows
        self.samples: list[dict] = []
        self._epoch: tuple[int, np.ndarray | None] = (-1, None)

    def _prompts(self, cfg: Config, data_dir: Path) -> list[dict]:
        path = self.tc.prompts or split_path(data_dir, "sft")
        rows = metrics.read_task_rows(path, on_bad_row=cfg.data.on_bad_row, max_line_bytes=cfg.data.max_line_bytes)
        numbered = list(enumerate(rows))        # row numbers of the split, before any family filter
        wanted = set(self.tc.families)
        if wanted:
            have = sorted({r["task"] for r in rows})
            if wanted - set(have):
                raise UserError(f"rl.families {sorted(wanted - set(have))} match no row of {path}; families there: {have}")
            numbered = [(k, r) for k, r in numbered if r["task"] in wanted]
        room = min(self.tc.seq_len, self.model.config.max_seq_len) - self.tc.max_new_tokens
        if room < 8:
            raise UserError(f"rl.seq_len ({self.tc.seq_len}) leaves {room} prompt tokens after rl.max_new_tokens "
                            f"({self.tc.max_new_tokens}); raise rl.seq_len")
        split = [metrics.prompt_and_answer(r["conversations"], f"{path}: row {k}") for k, r in numbered]
        # one template render per prompt, then one batched tokenizer call (per-prompt apply_chat_template: ~6 ms each)
        ids_all = prompt_ids_many(self.tok, [cut_messages(self.tok, prompt, room, keep="tail") for prompt, _ in split])
        out = [{"prompt": prompt, "reference": reference, "task": r["task"], "ids": ids}
               for (prompt, reference), (_, r), ids in zip(split, numbered, ids_all) if len(ids) <= room]
        if not out:
            raise UserError(f"rl: no prompt of {path} fits in rl.seq_len - rl.max_new_tokens = {room} tokens")
        if len(out) < len(split):
            log.warning("rl: %d of %d prompts are longer than rl.seq_len - rl.max_new_tokens = %d tokens even "
                        "cut; they are left out", len(split) - len(out), len(split), room)
        return out

    # engine/fit.py's data interface ----------------------------------------------------------------------
    def store(self, kind: str, tc, split: str | None = None):
        return self          # prompts are read once, in __init__: nothing to tokenise into a shared cache

    def batches(self, kind: str, tc: RLConfig, rank: int = 0, world_size: int = 1):
        def make(state: dict | None) -> Iterator[dict]:
            cursor = int(state["cursor"]) if state else 0
            while True:
                batch = self.rollout(cursor, rank, world_size)
                cursor += tc.batch_size * world_size
                batch["data_state"] = {"cursor": cursor}
                yield from chunks(batch, tc.train_chunks)
        return make, {"rl_prompts": len(self.rows), "rl_rewards": list(self.rewards)}

    # ------------------------------------------------------------------------------------------------------
    def _order(self, epoch: int) -> np.ndarray:
        if self._epoch[0] != epoch:
            self._epoch = (epoch, np.random.default_rng([self.tc.seed, epoch]).permutation(len(self.rows)))
        return self._epoch[1]

    def _take(self, cursor: int, rank: int, world_size: int) -> list[dict]:
        """This rank's prompts of the step starting at `cursor` (prompts drawn without replacement per epoch)."""
        n, out = len(self.rows), []
        for j in range(cursor + rank * self.tc.batch_size, cursor + (rank + 1) * self.tc.batch_size):
            out.append(self.rows[int(self._order(j // n)[j % n])])
        return out

    def rollout(self, cursor: int, rank: int = 0, world_size: int = 1) -> dict:
        tc, G = self.tc, self.tc.group_size
        rows = self._take(cursor, rank, world_size)
        seed = sampling_seed(tc.seed, cursor, rank)
        prompts = [r["ids"] for r in rows for _ in range(G)]
        if self.sampler is not None:
            self.sampler.sync(self.model)
            answers = self.sampler.sample([r["ids"] for r in rows], n=G, max_new_tokens=tc.max_new_tokens,
                                          temperature=tc.temperature, seed=seed)
        else:
            answers = self._own_answers(prompts, seed)
        stop = set(self.stop)
        scores = []
        for i, answer in enumerate(answers):
            row = rows[i // G]
            text = self.tok.decode(answer, skip_special_tokens=True)
            per = reward_fns.score(self.rewards, text, reference=row["reference"], prompt=row["prompt"],
                                   task=row["task"], finished=bool(answer) and answer[-1] in stop)
            scores.append(per)
            if i % G == 0:
                self._keep({"task": row["task"], "prompt": metrics.clip_sample(row["prompt"][-1]["content"]),
                            "reference": row["reference"], "answer": metrics.clip_sample(text), **per})
        total = torch.tensor([sum(s.values()) for s in scores]).view(len(rows), G)
        advantages = group_advantages(total).flatten()
        return self._batch(prompts, answers, advantages, total, scores)

    def _own_answers(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        generator = torch.Generator(device=decode.model_device(self.model)).manual_seed(seed)
        d = self.rt.dist
        lockstep = d.any if d is not None and dist.is_sharded(self.model) else bool
        with decode.evaluating(self.model), self.rt.autocast():
            return decode.sample_decode(self.model, prompts, max_new_tokens=self.tc.max_new_tokens, eos_id=self.stop,
                                          temperature=self.tc.temperature, generator=generator, any_running=lockstep,
                                          cuda_graph=decode.decode_graph_pays(self.model))

    def _keep(self, sample: dict) -> None:
        self.samples = (self.samples + [sample])[-SAMPLES_KEPT:]

    def _batch(self, prompts, answers, advantages, total, scores) -> dict:
        width = max(len(p) + len(a) for p, a in zip(prompts, answers))
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        labels = torch.full((len(prompts), width), IGNORE, dtype=torch.long)
        for r, (p, a) in enumerate(zip(prompts, answers)):
            ids[r, :len(p) + len(a)] = torch.tensor(p + a)
            labels[r, len(p):len(p) + len(a)] = torch.tensor(a)
        lengths = torch.tensor([len(a) for a in answers], dtype=torch.float32)
        per_reward = {f"rollout_reward_{name}": torch.tensor([s[name] for s in scores]).mean()
                      for name in self.rewards}
        return {"input_ids": ids, "labels": labels, "advantages": advantages.float(),
                "num_tokens": int(lengths.sum()), "capacity": ids.numel(),
                "rollout_reward_mean": total.mean(), "rollout_reward_std": total.std(unbiased=False),
                "rollout_completion_length": lengths.mean(),
                "rollout_flat_groups": (total.min(1).values == total.max(1).values).float().mean(), **per_reward}


def chunks(batch: dict, k: int) -> Iterator[dict]:
    """A rollout's batch as k micro-batches of equal numbers of answers (rl.train_chunks), each trimmed to its own
    longest row; the rollout's statistics and data state ride on every part. `token_norm` = the rollout's answer
    tokens / k, so that the token-level loss averaged over the parts is the whole rollout's token mean."""
    if k == 1:
        yield batch
        return
    n = batch["input_ids"].shape[0] // k
    norm = torch.tensor(batch["num_tokens"] / k)
    for c in range(k):
        rows = slice(c * n, (c + 1) * n)
        labels = batch["labels"][rows]
        answered = (labels != IGNORE).any(0).nonzero()
        width = int(answered.max()) + 1 if len(answered) else labels.shape[1]
        ids = batch["input_ids"][rows, :width]
        yield {**batch, "input_ids": ids, "labels": labels[:, :width], "advantages": batch["advantages"][rows],
               "num_tokens": int((labels != IGNORE).sum()), "capacity": ids.numel(), "token_norm": norm}
