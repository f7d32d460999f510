"""Mutation check of the simulator: each fsync and folder fsync the jobs ask the disk layer for is taken out in
turn (the recorder neither does nor records it) and the crash states of every job that asked for it are
checked again (those the missing sync can change). The simulator must find a lost commit, a lost or duplicated row, a wrong text or a failing
rerun for each sync the protocol needs. The ones it cannot catch are listed here with the reason they stay
(docs/design/durability.md says the same)."""
from __future__ import annotations

from batchjob.io import sink
from tests.durability.forked import claim, in_parts
from tests.durability.harness import check_states, record, release_memory
from tests.durability.jobs import scenarios

# syncs whose absence no crash state shows, and why they are kept
NOT_SHOWN = {
    # the snapshot's rename and its folder's fsync come first: whether or not the rename of the log it absorbed
    # survives, every record in that log is in the snapshot, and the next log's creation syncs the folder anyway
    "fsync_dir:io.manifest.commit<io.sink._compact":
        "after a compaction the absorbed log's rename may be lost harmlessly; kept so the folder is tidy at once",
    # job.json's name is synced again at once by the shard folder's creation beside it (its parent's fsync);
    # kept because every other shard plans from job.json: its durability must not rest on what follows
    "fsync_dir:io.manifest.atomic_write<sharding.shards.claim_shard":
        "the shard folder made next in the same folder syncs job.json's name too",
}


def sync_sites(recordings) -> dict[str, list[int]]:
    """Each sync site, and the jobs (by index) that asked for it."""
    sites: dict[str, list[int]] = {}
    for i, recording in enumerate(recordings):
        for op in recording.ops:
            if op.site and i not in sites.setdefault(op.site, []):
                sites[op.site].append(i)
    return sites


def test_removing_any_needed_sync_is_caught_by_the_simulator(model, inputs, reference, tmp_path, monkeypatch):
    monkeypatch.setattr(sink, "COMPACT_MIN_BYTES", 1500)
    jobs = scenarios(model, inputs, reference)
    recordings = [record(job, tmp_path / f"job-{i}", monkeypatch) for i, job in enumerate(jobs)]
    sites = sync_sites(recordings)

    claims = tmp_path / "claims"
    claims.mkdir()

    # the sites no crash state needs first: each of them checks every state its mutant can change (the others stop at
    # the first failure), the longest items of the sweep (one took 36 s of its 50 s), begun while the rest go past
    order = sorted(sites.items(), key=lambda item: (item[0] not in NOT_SHOWN, item[0]))

    def sweep(part: int, parts: int) -> tuple[dict[str, str], list[str]]:  # each site in the first forked copy free
        caught, missed = {}, []
        for n, (site, users) in enumerate(order):
            if not claim(claims, str(n)):
                continue
            release_memory()
            for i in users:
                mutant = record(jobs[i], tmp_path / f"mutant-{n}-{i}", monkeypatch, skip_sites=frozenset({site}))
                # only the states the skipped sync can change: the others are the unmutated job's (test_crash_states)
                outcome = check_states(jobs[i], mutant, tmp_path / f"states-{n}", stop_at_first=True,
                                       prefixes=mutant.unsynced_prefixes(), parts=1)
                if outcome.failures:
                    caught[site] = outcome.failures[0]
                    break
            else:
                missed.append(site)
        return caught, missed

    caught, missed = {}, []
    for found, lost in in_parts(sweep):
        caught.update(found)
        missed += lost
    print(f"{len(sites)} sync sites, {len(caught)} caught:\n" + "\n".join(f"{site}: {why[:160]}" for site, why in caught.items()))
    assert len(sites) >= 8, sorted(sites)
    assert sorted(missed) == sorted(s for s in NOT_SHOWN if s in sites), \
        f"syncs no crash state needs (remove them, or explain them in NOT_SHOWN): {sorted(set(missed) - set(NOT_SHOWN))}"
