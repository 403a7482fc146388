"""One training rank: a plain PyTorch script driven by the coordinator through RankClient.

    python rank.py --relay 127.0.0.1:PORT --salt-hex HEX --rank 2 --world-size 4 --out DIR

What it does with each control message:

- ``RequestNewNcclId``: serve a fresh ``torch.distributed.TCPStore`` on an ephemeral loopback
  port and answer ``NewNcclIdGenerated`` with its address (the rendezvous of the next group).
- ``NewNcclSession{uid, new_rank, new_world_size}``: leave the old gloo group (if any) and join
  the new one at that rendezvous, as ``new_rank`` of ``new_world_size``, then take the parameters
  of the group's rank 0 (a survivor: a rank whose host came back starts from them, not from
  scratch); the learning rate becomes ``--lr`` times the group's size, halved every 5 epochs
  (reported with ``LrUpdate``).
- ``StartEpoch`` / ``ExtendPartition``: queue sample ranges; they are trained in batches of
  ``--batch-size`` (never mixing two ranges), each reported with ``Batch``; when the queue runs
  dry, a cumulative ``Metrics`` for the epoch. A ``StartEpoch`` identical to the plan in progress
  and an ``ExtendPartition`` already received in the epoch are ignored: a coordinator that took
  the run over (after its predecessor was killed) sends each rank its share again.
- ``CoordinatorReconnecting`` / ``CoordinatorResumed`` (from the relay, while the coordinator is
  replaced): nothing to do; the rank trains on.
- ``SyncNow``: average the parameters over the group (``all_reduce``), then ``SyncAck``. If a
  peer died, the all-reduce fails fast; the rank acknowledges anyway and waits for its new
  session (the coordinator is re-forming the group).
- ``Checkpoint`` (to this rank): save the model, answer ``CheckpointResult``.
- ``Drain`` (from the relay: its host leaves, docs/elastic.rst): answer the next ``SyncNow``
  (at once, with no batch trained since the last one), then evaluate, write ``rank-R.json`` and
  leave: closing the client says ``Exiting``, and the coordinator retires the rank.
- ``Shutdown``: evaluate on the held-out split and write ``rank-R.json`` to ``--out``.

Every sample index in ``[0, train size)`` maps through a permutation seeded by the epoch, the same
on every rank, so contiguous partitions still shuffle the data.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import time
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import flodl_trio as ft
from flodl_trio import wire

LR_HALVING = 5  # epochs between halvings of the learning rate

log = logging.getLogger("torch_cpu.rank")
GROUP_TIMEOUT = datetime.timedelta(seconds=30)


def load_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The digits (8x8 images, 10 classes) that ship inside scikit-learn: nothing downloaded."""
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.25,
                                                        random_state=0, stratify=y)
    as_x = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    as_y = lambda a: torch.tensor(a, dtype=torch.long)  # noqa: E731
    return as_x(x_train), as_y(y_train), as_x(x_test), as_y(y_test)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # every rank starts from the same parameters
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


class Group:
    """The rank's current gloo process group, rebuilt on every ``NewNcclSession``."""

    def __init__(self) -> None:
        self.served: dict[str, dist.TCPStore] = {}  # rendezvous stores this rank serves
        self.size = 0
        self.rank = -1
        self.generations = 0

    def new_id(self) -> bytes:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=GROUP_TIMEOUT)
        uid = f"127.0.0.1:{store.port}"
        self.served[uid] = store
        return uid.encode()

    def join(self, uid: bytes, new_rank: int, new_world_size: int) -> None:
        self.leave()
        address = uid.decode()
        store = self.served.get(address)
        if store is None:
            host, port = address.rsplit(":", 1)
            store = dist.TCPStore(host, int(port), is_master=False, timeout=GROUP_TIMEOUT)
        dist.init_process_group("gloo", store=store, rank=new_rank, world_size=new_world_size,
                                timeout=GROUP_TIMEOUT)
        self.rank, self.size = new_rank, new_world_size
        self.generations += 1

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self.size, self.rank = 0, -1

    def adopt(self, model: torch.nn.Module) -> None:
        """Take the parameters of the group's rank 0 (the rank that served the rendezvous, a
        survivor), so that a rank that rejoined trains on from where the cohort is."""
        flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
        dist.broadcast(flat, src=0)
        torch.nn.utils.vector_to_parameters(flat, model.parameters())

    def average(self, model: torch.nn.Module) -> bool:
        """Average the parameters over the group; False if the group is broken (a peer died)."""
        if self.size == 0:
            return False
        try:
            flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
            dist.all_reduce(flat)
            torch.nn.utils.vector_to_parameters(flat / self.size, model.parameters())
        except RuntimeError as exc:
            log.warning("all-reduce failed (%s); waiting for a new session", str(exc)[:120])
            self.leave()
            return False
        return True


class Trainer:
    def __init__(self, args: argparse.Namespace, rc: ft.RankClient) -> None:
        self.args = args
        self.rc = rc
        self.rank = args.rank
        self.x, self.y, self.x_test, self.y_test = load_data()
        self.model = make_model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=0.9)
        self.group = Group()
        self.queue: deque[tuple[int, int]] = deque()
        self.epoch: int | None = None
        self.plan: tuple[int, int, int] | None = None  # (epoch, offset, size) in progress
        self.extensions: set[tuple[int, int]] = set()  # received in the current epoch
        self.order = torch.arange(len(self.x))
        self.out = Path(args.out)
        self.epoch_started = 0.0
        self.batches = self.samples = 0
        self.loss_sum = self.compute_ms = 0.0
        self.syncs = self.failed_syncs = 0
        self.unsynced = 0  # batches trained since the last SyncNow
        self.leaving: wire.Drain | None = None  # its host drains: leave after the next sync

    def run(self) -> None:
        while True:
            # A draining rank trains nothing more: what it trained waits for the sync.
            busy = self.queue and self.leaving is None
            msg = self.rc.recv(timeout=0 if busy else None)
            if msg is None:
                self.train_one_batch()
                continue
            if isinstance(msg, wire.Shutdown | wire.ShutdownWithSave):
                self.finish(msg)
                return
            if isinstance(msg, wire.Drain):
                self.leaving = msg
            else:
                self.on_message(msg)
            if self.leaving is not None and self.unsynced == 0:
                self.finish(self.leaving)
                return

    def set_lr(self) -> None:
        """``--lr`` times the group's size (linear scaling: an average over fewer replicas is a
        smaller batch, so a smaller step, and the progress per epoch does not depend on how many
        survived), halved every ``LR_HALVING`` epochs so that both runs settle."""
        halvings = (self.epoch or 0) // LR_HALVING
        lr = self.args.lr * self.group.size * 0.5 ** halvings
        if all(group["lr"] == lr for group in self.opt.param_groups):
            return
        for param_group in self.opt.param_groups:
            param_group["lr"] = lr
        self.rc.send(wire.LrUpdate(rank=self.rank, lr=lr))

    def on_message(self, msg: wire.ControlMsg) -> None:
        rc = self.rc
        if isinstance(msg, wire.RequestNewNcclId):
            rc.send(wire.NewNcclIdGenerated(rank=self.rank, uid=self.group.new_id()))
        elif isinstance(msg, wire.NewNcclSession):
            self.group.join(msg.uid, int(msg.new_rank), int(msg.new_world_size))
            self.group.adopt(self.model)
            self.set_lr()
            log.info("rank %d: joined group %s as %d/%d", self.rank, msg.uid.decode(),
                     msg.new_rank, msg.new_world_size)
        elif isinstance(msg, wire.StartEpoch):
            plan = msg.plan
            key = (int(plan.epoch), int(plan.partition_offset), int(plan.partition_size))
            if key == self.plan:  # a coordinator that took the run over repeats it: ignore
                return
            self.plan, self.extensions = key, set()
            self.epoch = int(plan.epoch)
            self.set_lr()
            generator = torch.Generator().manual_seed(1000 + self.epoch)
            self.order = torch.randperm(len(self.x), generator=generator)
            self.queue = deque([(int(plan.partition_offset), int(plan.partition_size))])
            self.epoch_started = time.monotonic()
            self.batches = self.samples = 0
            self.loss_sum = self.compute_ms = 0.0
        elif isinstance(msg, wire.ExtendPartition):
            extension = (int(msg.partition_offset), int(msg.partition_size))
            if extension not in self.extensions:  # a repeated one is ignored, as above
                self.extensions.add(extension)
                self.queue.append(extension)
        elif isinstance(msg, wire.SyncNow):
            if self.group.average(self.model):
                self.syncs += 1
            else:
                self.failed_syncs += 1
            self.unsynced = 0
            rc.send(wire.SyncAck(rank=self.rank, step_count=rc.step_count))
        elif isinstance(msg, wire.Checkpoint) and msg.target_rank == self.rank:
            started = time.monotonic()
            torch.save(self.model.state_dict(), self.out / f"checkpoint-v{msg.version}.pt")
            rc.send(wire.CheckpointResult(rank=self.rank, version=msg.version,
                                          elapsed_ms=(time.monotonic() - started) * 1000))

    def train_one_batch(self) -> None:
        offset, size = self.queue[0]
        n = min(self.args.batch_size, size)
        if n == 0:
            self.queue.popleft()
            self.report_if_done()
            return
        started = time.monotonic()
        index = self.order[offset:offset + n]
        self.opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(self.model(self.x[index]), self.y[index])
        loss.backward()
        self.opt.step()
        if self.args.step_ms > 0:  # stands in for a bigger model on a real device
            time.sleep(self.args.step_ms / 1000)
        elapsed_ms = (time.monotonic() - started) * 1000
        self.queue[0] = (offset + n, size - n)
        if n == size:
            self.queue.popleft()
        self.batches += 1
        self.samples += n
        value = loss.item()
        self.loss_sum += value
        self.compute_ms += elapsed_ms
        self.rc.step_count += 1
        self.unsynced += 1
        self.rc.send(wire.Batch(rank=self.rank, batch_ms=elapsed_ms, data_ms=0.0,
                                step_count=self.rc.step_count, param_norm=None,
                                batch_loss=value))
        self.report_if_done()

    def report_if_done(self) -> None:
        if self.queue or self.epoch is None:
            return
        epoch_ms = (time.monotonic() - self.epoch_started) * 1000
        self.rc.send(wire.Metrics(
            rank=self.rank, epoch=self.epoch,
            avg_loss=self.loss_sum / self.batches if self.batches else 0.0,
            batches_processed=self.batches, epoch_ms=epoch_ms, samples_processed=self.samples,
            share_complete_ms=epoch_ms, compute_only_ms=self.compute_ms, data_starve_ms=0.0,
            scalars={"loss": (self.loss_sum, self.batches)}))

    def finish(self, msg: wire.ControlMsg) -> None:
        with torch.no_grad():
            predicted = self.model(self.x_test).argmax(dim=1)
        accuracy = float((predicted == self.y_test).float().mean())
        result = {"rank": self.rank, "accuracy": accuracy, "test_samples": len(self.y_test),
                  "syncs": self.syncs, "failed_syncs": self.failed_syncs,
                  "groups_joined": self.group.generations, "ended_with": type(msg).__name__}
        (self.out / f"rank-{self.rank}.json").write_text(json.dumps(result))
        self.group.leave()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--relay", required=True, metavar="HOST:PORT")
    p.add_argument("--salt-hex", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--out", required=True, help="directory for checkpoints and the result")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.025,
                   help="SGD learning rate per replica: the group of n ranks uses n times it")
    p.add_argument("--step-ms", type=float, default=0.0, help="extra time per batch")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format=f"rank {args.rank}: %(message)s")
    torch.set_num_threads(1)  # four ranks share two cores
    host, port = args.relay.rsplit(":", 1)
    config = ft.RankConfig(heartbeat_interval=0.5)
    with ft.RankClient((host, int(port)), salt=ft.SessionSalt.from_hex(args.salt_hex),
                       rank=args.rank, world_size=args.world_size, config=config) as rc:
        Trainer(args, rc).run()


if __name__ == "__main__":
    main()
