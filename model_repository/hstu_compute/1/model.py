"""hstu_compute: one jagged batch of users through the AOTI package, per `execute`.

Dynamic batching hands `execute` every queued request; their new tokens, page rows and
candidates are ragged, so the batch is formed here (`PagedBatch.from_requests`), not padded by
Triton. The package reads each user's cached prefix from the shared page pool and writes the new
tokens' KV into it. If the batch fails, each request is retried alone so one bad request fails
alone; a failed request's lease is aborted so its pages return at once. It answers with the
scores only: kv_offload takes the request's lease id from kv_lookup_alloc itself.

Onboarding from the store's shared DRAM tier (the default with the embedded store): the plan
names the onboard pages' keys (`onboard_keys`). `execute` finds where the batch's pages sit in the
store's shared slab (its index, read without a round trip; `locate` asks the store for pages the
index does not show), queues their copy into the pool on the forward's own stream
(`OnboardReader.start`), and computes those requests with the rest of the batch: the forward runs
after the copy on the GPU, and the host does not wait for it. Once the forward is launched and the
copy has ended, a request whose slab rows the store reused meanwhile is computed again without
them (`OnboardReader.finish`); a page the store no longer holds is computed in the first place.
Before it answers, `execute` tells the owner how many pages of each lease it copied (one datagram
per sub-batch, `CommitSender.report_read`), so that their commit does not offload them back to
the store.

Onboarding by the store (a store whose DRAM tier is not shared, or HSTU_HOST_HIT_COPY=store):
kv_lookup_alloc answers a request with pages beyond its device prefix before the
host store is even asked about them (`onboard_len` > 0). `execute` hands those to the settler
thread, which asks the owner's control plane how the onboards ended (`onboard_wait`, one round
trip for all of them), and meanwhile computes the batch's other requests; then each onboarded
request is computed: it reads what was copied and computes the rest (pages the store did not
hold, or a failed or late copy, are computed; a copy that may still be running moves the request
to fresh pages). The device hits' forward overlaps the copies' wait.

Answers: `execute` waits for each forward's scores and returns every answer in its list (a
batch with a store-copied host hit returns once that copy is settled, at most the owner's onboard
wait). A plan that fails its checks is answered retryable; the scores go out sealed with a
checksum row (`sealed_scores`).

Every compiled forward runs on the thread that calls `execute` (the stub's main thread: it runs one
`execute` at a time); the settler only waits on the control plane. One thread, because OpenMP (the
CPU package's intra-op threads) gives each OS thread that starts a parallel region a thread team of
its own, and with more team threads than cores every barrier sleeps instead of spinning: once a
second thread had computed too, every call of the CPU package took 2.5x as long on the 2-core CPU
machine. Computing on `execute`'s own thread rather than on a thread of its own is the simpler of
the two, and measured no slower (docs/ARCHITECTURE.md, hstu_compute).

Versions (a rollout): a version folder that holds its own model (`hstu_config.json`, weights,
AOTI package) serves that model; one without (the shipped `1/`, only this file) serves
`HSTU_MODEL_DIR`. At load, the version publishes its KV namespace (the fingerprint of its
weights) and kv_lookup_alloc makes new leases in it. A lease made in another namespace (in
flight while the version changed) is refused: its cached prefix holds KV other weights computed.
It is aborted and answered with a retryable error, which the project's clients resend.
"""
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import triton_python_backend_utils as pb_utils

from compute import HSTUConfig, PagedBatch, load_compiled, plan_sub_batches
from compute.batch import CALL_COST
from compute.build import read_build_key
from compute.config import CONFIG_FILENAME
from compute.graphs import GRAPH_STATS_KEYS
from deploy.runtime import published
from deploy.runtime import sealed_scores
from deploy.runtime.cache_owner import open_store_client
from deploy.runtime.compute_plan import ComputePlan
from deploy.runtime.onboard_reader import OnboardReader, QueuedOnboard
from deploy.runtime.settings import ServingSettings
from deploy.runtime.triton_io import Reply, error_response, input_tensor, output_tensor
from deploy.runtime.triton_metrics import KVMetrics, StageTimer, stage_keys
from kvlifecycle.commit_channel import CommitSender
from kvlifecycle.control import ControlClient, OnboardOutcome
from kvlifecycle.hashing import namespace_tag
from kvlifecycle.pool import PagePool

logger = logging.getLogger("hstu_compute")


class TritonPythonModel:
    def initialize(self, args):
        self.settings = ServingSettings.from_env()
        self.settings.prepare_run_dir()  # the owner's pool handle and control socket live there
        self.device = torch.device(self.settings.device)
        if self.device.type == "cuda":
            # The host's tensor ops here are small; torch's intra-op pool (one thread per core) wakes
            # a team per parallel_for and leaves it spinning on cores the other steps need
            # (docs/ARCHITECTURE.md, hstu_compute).
            torch.set_num_threads(1)
        self.version = args["model_version"]
        self.model_dir = self._model_dir(Path(args["model_repository"]) / self.version)
        self.run = load_compiled(self.model_dir, self.settings.device, cuda_graphs=self.settings.cuda_graphs)
        # load_compiled checked the package's build key against the folder; the key holds the
        # weights' fingerprint, so it is read back rather than hashed again (seconds on large weights).
        self.namespace = read_build_key(self.model_dir, self.device.type)["fingerprint"]
        self.namespace_tag = namespace_tag(self.namespace)
        self.page_size = HSTUConfig.load(self.model_dir).page_size
        self.control = ControlClient(self.settings.control_endpoint)
        self.pool = None  # attached at the first request: the owner may not have published it yet
        self.published_pool = published.pool_handle_file(self.settings)
        # The owner settles a copy within its onboard wait; the reply may take one control timeout more.
        self.onboard_wait_timeout_s = self.settings.timeouts.onboard_wait_s + self.settings.timeouts.control_s
        self.stages = StageTimer()
        self.metrics = KVMetrics(args["model_name"], args["model_instance_name"],
                                 [*stage_keys("onboard", "compute", "compute_call"), *GRAPH_STATS_KEYS,
                                  *OnboardReader.STATS_KEYS],
                                 source=self._stats)
        self._settler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hstu-compute-settler")
        self.reader = (OnboardReader(open_store_client(self.settings, self.page_size),
                                     pin_s=self.settings.timeouts.onboard_wait_s)
                       if self.settings.store == "embedded" else None)
        # tells the owner which onboard pages the reader copied (they are in the store: not offloaded again)
        self.read_reports = CommitSender(self.settings.control_endpoint, reply_endpoint="") if self.reader else None
        if self.reader is not None:  # map the store's slab now, not at the first host hit
            threading.Thread(target=self.reader.warm_up, name="hstu-compute-slab-warm-up", daemon=True,
                             args=(self.settings.pool_handle_path.exists, self.device.type == "cuda")).start()
        published.publish(self.settings.compute_version_path, {
            "version": self.version, "namespace": self.namespace, "model_dir": str(self.model_dir),
            "server_pid": os.getppid(),  # the tritonserver: kv_lookup_alloc ignores a previous server's file
        })
        logger.info("hstu_compute version %s: model %s, KV namespace %s", self.version, self.model_dir,
                    self.namespace[:12])

    def execute(self, requests):
        pending = [ComputeRequest() for _ in requests]
        try:
            ready, onboarding, reading = [], [], []
            for p, request in zip(pending, requests):
                plan = self._parse(request)
                if isinstance(plan, str):  # the owner wrote it: a transport fault, not the client's
                    p.answer(error_response(plan, retryable=True))
                elif plan.namespace_tag != self.namespace_tag:
                    self._abort(plan.lease_id)
                    p.answer(error_response(
                        f"hstu_compute: lease {plan.lease_id} was made for another model version's KV (this is "
                        f"version {self.version}; a rollout happened while the request was in flight)", retryable=True))
                else:
                    p.plan = plan
                    (reading if plan.onboard_keys.shape[0] else onboarding if plan.onboard_len else ready).append(p)
            settled = self._settler.submit(self._settle_onboards, onboarding) if onboarding else None
            if reading:  # copied from the store's slab, computed with the batch
                self._read_onboards(reading)
            self._compute(ready + reading)  # while the store's onboards are settled
            if settled is not None:
                self._compute(settled.result())
        except Exception as e:  # a bug: whatever is unanswered fails, not the instance
            logger.error("hstu_compute failed on a batch of %d", len(requests), exc_info=True)
            for p in pending:
                p.answer(error_response(f"hstu_compute: internal error: {e}"))
            for p in pending:  # a slab copy still queued must end (and count) before execute returns
                if p.read is not None:
                    self.reader.finish(p.read[0])
        return [p.response for p in pending]

    def finalize(self):
        self._settler.shutdown()
        if self.reader is not None:
            self.reader.close()
            self.read_reports.close()
        self.metrics.close()
        self.control.close()
        if self.pool is not None:
            self.pool.close()

    # ---- helpers ----------------------------------------------------------------------------

    def _compute(self, items: list["ComputeRequest"]) -> None:
        """Score `items` and answer each (on `execute`'s thread only)."""
        if not items:
            return
        # (queries, keys) of each request: the padded forward's cost grows with the largest of both.
        shapes = [(p.plan.new_tokens.numel() + p.plan.candidates.numel(), p.plan.cached_len + p.plan.new_tokens.numel())
                  for p in items]
        pool = self._attach_pool()
        for group in plan_sub_batches(shapes, CALL_COST[self.device.type]):
            members = [items[j] for j in group]
            started = time.perf_counter()
            try:
                scores = self._launch(pool, [p.plan for p in members])  # on the device: queued, not awaited
            except Exception:
                logger.warning("batch of %d failed; retrying one by one", len(members), exc_info=True)
                for p in members:
                    self._read_intact(p)
                    p.answer(self._score_alone(pool, p.plan))
                continue
            # a request whose copy read slab rows the store reused is computed again without them
            intact = [self._read_intact(p) for p in members]
            again = [p for p, ok in zip(members, intact) if not ok]
            self._report_read(members)  # before the answers: kv_offload commits on them
            # To the host: the copy waits for the KV writes queued before it (kv_offload commits
            # them next), and a host tensor leaves the Python backend without a CUDA IPC handle.
            responses = self._responses(scores.cpu(), [int(p.plan.candidates.numel()) for p in members])
            # each request it answers spent the whole call in compute (one computed again counts once, there)
            seconds = time.perf_counter() - started
            self.stages.add("compute", seconds, sum(intact))
            self.stages.add("compute_call", seconds)
            for p, ok, response in zip(members, intact, responses):
                if ok:
                    p.answer(response)
            self._compute(again)

    def _stats(self) -> dict[str, float]:
        reader = self.reader.stats() if self.reader is not None else dict.fromkeys(OnboardReader.STATS_KEYS, 0)
        return {**self.stages.stats(), **self.run.stats, **reader}

    def _read_onboards(self, items: list["ComputeRequest"]) -> None:
        """Queue the copy of `items`' onboard pages from the store's slab; each plan then reads
        what is queued and computes the rest (`_read_intact` checks the copy after the forward)."""
        started = time.perf_counter()
        if self.reader is None:  # a plan with keys from an owner whose store this model does not reach
            for p in items:
                p.plan = p.plan.after_onboard(0)
            return
        queued = self.reader.start(self._attach_pool(), [p.plan for p in items])
        for i, (p, pages) in enumerate(zip(items, queued.pages)):
            p.unread_plan, p.read = p.plan, (queued, i)
            p.plan = p.plan.after_onboard(pages * self.page_size)
        self.stages.add("onboard", time.perf_counter() - started, len(items))

    def _read_intact(self, p: "ComputeRequest") -> bool:
        """Whether the pages `p` read from the slab copy were right (or it read none); if not,
        `p.plan` becomes the plan that computes them. Call once the forward that reads them is
        launched (this waits for the copy, not for the forward)."""
        if p.read is None:
            return True
        queued, i = p.read
        p.read = None
        intact = p.copied_pages = self.reader.finish(queued)[i]
        if intact == queued.pages[i]:
            return True
        p.plan = p.unread_plan.after_onboard(intact * self.page_size)
        return False

    def _report_read(self, items: list["ComputeRequest"]) -> None:
        """Tell the owner how many leading onboard pages of each lease of `items` were copied from
        the store (unsent, the commit offers them to the store again, which skips them)."""
        copied = [(p.plan.lease_id, p.copied_pages) for p in items if p.copied_pages]
        if not copied:
            return
        for p in items:  # reported once, though a request computed again passes here twice
            p.copied_pages = 0
        if not self.read_reports.report_read(*zip(*copied)):
            logger.debug("hstu_compute: the owner's inbox did not take the report of %d leases", len(copied))

    def _model_dir(self, version_dir: Path) -> Path:
        """The version folder if it holds a model, else HSTU_MODEL_DIR (`compute_model_dir`). A version
        must keep the owner's request limits and KV geometry (one pool and one validation serve all)."""
        model_dir = self.settings.compute_model_dir(version_dir)
        if model_dir == self.settings.model_dir:
            return model_dir
        mismatch = HSTUConfig.load(self.settings.model_dir).serving_mismatch(HSTUConfig.load(version_dir))
        if mismatch:
            raise ValueError(f"hstu_compute version {self.version}: {version_dir / CONFIG_FILENAME} differs from "
                             f"the serving config {self.settings.model_dir / CONFIG_FILENAME} in "
                             f"{'; '.join(mismatch)}: a new version may change weights and width, not the request "
                             "limits or the KV geometry; restart the server with the new HSTU_MODEL_DIR instead")
        return version_dir

    def _parse(self, request) -> ComputePlan | str:
        """The request's plan, or an error message."""
        try:
            return ComputePlan.unpack(input_tensor(request, "compute_plan"))
        except Exception as e:
            return f"hstu_compute: malformed request: {e}"

    def _settle_onboards(self, items: list["ComputeRequest"]) -> list["ComputeRequest"]:
        """Wait for the copies of `items` (host hits) to be settled by the owner; those left to
        compute, each now reading what was copied and computing the rest. A request whose lease is
        gone, or whose outcome cannot be learnt, is answered with an error (its pages may still be
        written)."""
        if not items:
            return []
        started = time.perf_counter()
        lease_ids = [p.plan.lease_id for p in items]
        try:
            outcomes = self.control.onboard_wait(lease_ids, timeout_s=self.onboard_wait_timeout_s)
        except Exception as e:
            logger.error("hstu_compute: no onboard outcome for leases %s", lease_ids, exc_info=True)
            for p in items:
                self._abort(p.plan.lease_id)
                p.answer(error_response(f"hstu_compute: cannot learn whether lease {p.plan.lease_id}'s "
                                        f"host-store copy ended ({e}); retry the request"))
            return []
        self.stages.add("onboard", time.perf_counter() - started, len(items))
        settled = []
        for p, outcome in zip(items, outcomes):
            plan = self._settled(p.plan, outcome)
            if plan is None:
                p.answer(error_response(f"hstu_compute: lease {outcome.lease_id}: {outcome.error}"))
            else:
                p.plan = plan
                settled.append(p)
        return settled

    @staticmethod
    def _settled(request: ComputePlan, outcome: OnboardOutcome) -> ComputePlan | None:
        """The request as its settled onboard leaves it: the tokens not copied are computed."""
        if outcome.cached_len is None:
            return None
        device_len = request.cached_len - request.onboard_len
        assert device_len <= outcome.cached_len <= request.cached_len, (
            f"lease {outcome.lease_id}: the owner settled cached_len {outcome.cached_len}, expected "
            f"{device_len}..{request.cached_len}")
        return request.after_onboard(outcome.cached_len - device_len,
                                     page_row=torch.as_tensor(outcome.page_row, dtype=torch.int64))

    def _launch(self, pool: PagePool, items: list[ComputePlan]) -> torch.Tensor:
        """The batch's scores [sum c, num_tasks] on the pool's device (on the GPU, queued)."""
        batch = PagedBatch.from_requests([(r.new_tokens, r.cached_len, r.page_row, r.candidates) for r in items])
        return self.run(pool.tensor, batch)

    def _score_alone(self, pool: PagePool, item: ComputePlan):
        """The answer of `item` computed alone, returned (a retry after its batch failed)."""
        try:
            return self._responses(self._launch(pool, [item]).cpu(), [int(item.candidates.numel())])[0]
        except Exception as e:
            logger.error("hstu_compute failed on lease %d", item.lease_id, exc_info=True)
            self._abort(item.lease_id)  # its pages return now, not at lease expiry
            # A plan that does not fit the pool or the model (ValueError from its checks) arrived
            # other than the owner wrote it (it validated the request): resending it is right.
            return error_response(f"hstu_compute: {e}", retryable=isinstance(e, ValueError))

    def _responses(self, scores: torch.Tensor, candidates: list[int]) -> list:
        """The answer of each request of a forward: its rows of the host `scores` [sum c, num_tasks]
        (`candidates`: each request's c, in order), sealed with their checksum row."""
        return [pb_utils.InferenceResponse(output_tensors=[output_tensor("candidate_scores", sealed.unsqueeze(0))])
                for sealed in sealed_scores.seal_batch(scores, candidates)]  # each [1, c + 1, num_tasks]

    def _abort(self, lease_id: int) -> None:
        try:
            self.control.abort(lease_id)
        except Exception:
            logger.warning("abort of lease %d not delivered; it expires instead", lease_id, exc_info=True)

    def _attach_pool(self) -> PagePool:
        handle = self.published_pool.poll()  # a new handle when kv_lookup_alloc (re)published it
        if handle is not None:
            if self.pool is not None:
                self.pool.close()
            self.pool = PagePool.attach(handle)
        return self.pool


class ComputeRequest(Reply):
    """A request of a batch until it is answered, with its plan once parsed."""

    def __init__(self) -> None:
        super().__init__()
        self.plan: ComputePlan | None = None
        # a host hit read from the store's slab: its plan before that, and (the batch's queued copy, its index)
        self.unread_plan: ComputePlan | None = None
        self.read: tuple[QueuedOnboard, int] | None = None
        self.copied_pages = 0  # of them, the leading onboard pages the copy got right
