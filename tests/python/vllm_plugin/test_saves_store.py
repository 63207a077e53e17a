"""fragments.vllm._saves.SavesStore without vLLM: the bounds on saves waiting in a worker (docs/vllm.md, "The
OpenAI server"). A fake clock drives expiry; tensors are small float32 rows.

    PYTHONPATH=python python tests/python/vllm_plugin/test_saves_store.py
"""
import logging
import os
import unittest
from unittest import mock

import torch
from safetensors.torch import load

from fragments.vllm import _saves
from fragments.vllm._saves import SavesStore


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def rows(n, width=4, fill=1.0):
    return torch.full((n, width), fill, dtype=torch.float32)  # n * width * 4 bytes


def store(clock=None, keep=True, **settings):
    env = {f"FRAGMENTS_VLLM_{k}": str(v) for k, v in settings.items()}
    with mock.patch.dict(os.environ, env):
        return SavesStore(keep=keep, clock=clock or Clock())


class SavesStoreTest(unittest.TestCase):
    def setUp(self):
        logging.getLogger("fragments.vllm").setLevel(logging.CRITICAL)  # drops are logged; not here

    def test_a_key_fetches_its_saves_once_in_step_order(self):
        s = store()
        s.open("a")
        s.add("a", "h", rows(3, fill=1.0))
        s.add("a", "h", rows(1, fill=2.0))
        s.add("a", "x", torch.tensor(5.0))
        s.add("a", "x", torch.tensor(6.0))
        first = s.take("a")
        self.assertEqual(first["status"], "ok")
        self.assertEqual(first["bytes"], 4 * 4 * 4 + 2 * 4)
        saves = load(first["data"])
        self.assertEqual(saves["h"][:, 0].tolist(), [1.0, 1.0, 1.0, 2.0])
        self.assertEqual(saves["x"].tolist(), [5.0, 6.0])
        second = s.take("a")
        self.assertEqual(second["status"], "taken")
        self.assertIn("already fetched", second["error"])
        self.assertIsNone(second["data"])
        self.assertEqual(s.take("never")["status"], "unknown")
        self.assertEqual(s.stats()["bytes"], 0)

    def test_rows_of_steps_past_the_requests_tokens_are_left_out(self):
        # async scheduling runs a request one step past its last token; that step's rows are not its saves
        s = store()
        s.open("a")
        for step in range(4):
            s.add("a", "logits", rows(1, fill=float(step)), step=step)
        s.add("a", "only_late", rows(1), step=3)
        saves = load(s.take("a", steps=3)["data"])
        self.assertEqual(saves["logits"][:, 0].tolist(), [0.0, 1.0, 2.0])
        self.assertNotIn("only_late", saves)  # nothing of it in the steps the request had
        s.open("b")
        s.add("b", "h", rows(2), step=0)
        self.assertEqual(load(s.take("b")["data"])["h"].shape[0], 2)  # no count: every row

    def test_finished_tokens_are_counted_once_per_key_and_bounded(self):
        t = _saves.FinishedTokens(limit=2)
        t.started("r1", "k1")
        t.finished("r1", 5)
        t.finished("r-unknown", 3)  # a request without a plan: nothing kept
        self.assertEqual(t.pop("k1"), 5)
        self.assertIsNone(t.pop("k1"))
        t.started("r2", "k2")
        t.aborted("r2")
        t.finished("r2", 4)  # aborted first: no count
        self.assertIsNone(t.pop("k2"))
        for i in range(3):
            t.started(f"q{i}", f"c{i}")
            t.finished(f"q{i}", i)
        self.assertIsNone(t.pop("c0"))  # the oldest left past the limit
        self.assertEqual(t.pop("c2"), 2)

    def test_saves_are_copies(self):
        s = store()
        s.open("a")
        t = rows(2)
        s.add("a", "h", t)
        t.fill_(9.0)
        self.assertEqual(load(s.take("a")["data"])["h"].max().item(), 1.0)

    def test_a_request_over_its_cap_is_truncated_with_the_reason(self):
        s = store(MAX_SAVE_BYTES=100)
        s.open("a")
        s.add("a", "h", rows(4))  # 64 bytes
        s.add("a", "h", rows(4))  # would be 128: not kept, nor anything after
        s.add("a", "g", rows(1))
        out = s.take("a")
        self.assertEqual(out["status"], "ok")
        self.assertEqual(load(out["data"])["h"].shape, (4, 4))
        self.assertNotIn("g", load(out["data"]))
        self.assertIn("FRAGMENTS_VLLM_MAX_SAVE_BYTES", out["error"])
        self.assertEqual(s.stats()["dropped"], {"request_cap": 1})

    def test_a_full_store_evicts_finished_requests_oldest_first_and_says_why(self):
        clock = Clock()
        s = store(clock, SAVES_MAX_BYTES=200)
        for key in ("old", "newer", "running"):
            s.open(key)
            s.add(key, "h", rows(4))  # 64 bytes each: 192 held
            clock.now += 1
        s.finish("newer")
        s.finish("old")  # finished last, but "newer" finished first: it goes first
        s.open("big")
        s.add("big", "h", rows(4))  # 256 > 200: one finished request must go
        self.assertEqual(s.take("newer")["status"], "dropped")
        self.assertIn("FRAGMENTS_VLLM_SAVES_MAX_BYTES", s.take("newer")["error"])
        self.assertEqual(s.take("old")["status"], "ok")
        s.add("big", "h", rows(8))  # 128 more: only running requests are left, so big is truncated
        big = s.take("big")
        self.assertEqual(load(big["data"])["h"].shape, (4, 4))
        self.assertIn("store is full", big["error"])
        self.assertEqual(s.take("running")["status"], "ok")
        self.assertEqual(s.stats()["bytes"], 0)

    def test_finished_saves_expire_running_ones_do_not(self):
        clock = Clock()
        s = store(clock, SAVES_TTL=60)
        s.open("done")
        s.add("done", "h", rows(2))
        s.finish("done")
        s.open("long")
        s.add("long", "h", rows(2))
        clock.now += 59
        self.assertEqual(s.stats()["requests"], 2)
        clock.now += 2
        stats = s.stats()
        self.assertEqual((stats["requests"], stats["bytes"], stats["dropped"]), (1, 32, {"expired": 1}))
        gone = s.take("done")
        self.assertEqual(gone["status"], "dropped")
        self.assertIn("FRAGMENTS_VLLM_SAVES_TTL", gone["error"])
        clock.now += 10_000  # a request still running keeps its saves however long it runs
        self.assertEqual(s.take("long")["status"], "ok")

    def test_the_count_cap_evicts_finished_requests_then_refuses(self):
        s = store(SAVES_MAX_REQUESTS=2)
        s.open("a")
        s.finish("a")
        s.open("b")
        s.open("c")  # a (finished) makes room
        self.assertEqual(s.take("a")["status"], "dropped")
        s.open("d")  # b and c run: d keeps nothing and says so
        s.add("d", "h", rows(1))
        d = s.take("d")
        self.assertEqual(d["status"], "dropped")
        self.assertIn("FRAGMENTS_VLLM_SAVES_MAX_REQUESTS", d["error"])
        self.assertEqual(s.stats()["dropped"], {"too_many_requests": 2})

    def test_a_dropped_key_keeps_nothing_even_when_its_request_runs_later(self):
        s = store()
        s.open("a")
        s.add("a", "h", rows(2))
        s.drop("a", _saves.DISCONNECTED, "the client disconnected")
        s.add("a", "h", rows(2))  # a step already under way when the abort came
        s.drop("b", _saves.DISCONNECTED, "the client disconnected")  # before b ever ran
        s.open("b")
        s.add("b", "h", rows(2))
        stats = s.stats()
        self.assertEqual((stats["requests"], stats["bytes"]), (0, 0))
        self.assertEqual(s.take("a"), {"status": "dropped", "error": "the client disconnected", "data": None,
                                       "bytes": 0})
        self.assertEqual(s.take("b")["status"], "dropped")

    def test_a_taken_key_used_again_starts_afresh(self):
        s = store()
        s.open("k")
        s.add("k", "h", rows(1, fill=1.0))
        s.take("k")
        s.add("k", "h", rows(1))  # late: ignored
        s.open("k")  # fragments.vllm's callers may reuse a key
        s.add("k", "h", rows(1, fill=3.0))
        self.assertEqual(load(s.take("k")["data"])["h"][:, 0].tolist(), [3.0])

    def test_errors_first_one_wins_and_come_back_with_the_saves(self):
        s = store()
        s.open("a", None)
        self.assertEqual(s.fail("a", "first"), "first")
        self.assertEqual(s.fail("a", "second"), "first")
        out = s.take("a")
        self.assertEqual((out["status"], out["error"], out["data"]), ("ok", "first", None))
        self.assertEqual(s.fail("gone", "x"), "x")

    def test_a_rank_that_keeps_nothing_keeps_the_bookkeeping(self):
        s = store(keep=False)
        s.open("a", "bad plan")
        s.add("a", "h", rows(100))
        self.assertEqual(s.stats()["bytes"], 0)
        self.assertEqual(s.take("a"), {"status": "ok", "error": "bad plan", "data": None, "bytes": 0})
        self.assertEqual(s.take("a")["status"], "taken")

    def test_remembered_keys_are_bounded(self):
        s = store(SAVES_MAX_REQUESTS=2)
        for i in range(100):
            s.open(str(i))
            s.take(str(i))
        self.assertEqual(s.stats()["remembered"], 8)
        self.assertEqual(s.take("0")["status"], "unknown")
        self.assertEqual(s.take("99")["status"], "taken")

    def test_a_bad_setting_is_one_line_naming_it(self):
        for text in ("lots", "0", "-5", "1.5"):
            with self.assertRaises(ValueError) as ctx:
                store(SAVES_TTL=text)
            self.assertIn("FRAGMENTS_VLLM_SAVES_TTL", str(ctx.exception))
            self.assertNotIn("\n", str(ctx.exception))

    def test_memory_stays_bounded_under_churn(self):
        """10^4 requests, a third never fetched, a third disconnected: what is held stays under the caps."""
        clock = Clock()
        s = store(clock, SAVES_MAX_BYTES=4096, SAVES_MAX_REQUESTS=32, SAVES_TTL=5)
        worst = 0
        for i in range(10_000):
            key = f"r{i}"
            s.open(key)
            s.add(key, "h", rows(4))
            s.finish(key)
            if i % 3 == 0:
                self.assertEqual(s.take(key)["status"], "ok")
            elif i % 3 == 1:
                s.drop(key, _saves.DISCONNECTED, "gone")
            clock.now += 0.01
            stats = s.stats()
            worst = max(worst, stats["bytes"])
            self.assertLessEqual(stats["requests"], 32)
            self.assertLessEqual(stats["remembered"], 128)
        self.assertLessEqual(worst, 4096)


if __name__ == "__main__":
    unittest.main(verbosity=2)
