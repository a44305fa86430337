"""Median of N in-process applies (patcher.protocol.apply, stores kept) on a branch not checked out, 1k files.

Usage: python bench/api_median.py SOURCE_TREE [N]   (SOURCE_TREE: a checkout of oncepatch, e.g. a
'git worktree add /tmp/before <commit>', so that two versions can be compared on one machine).
NOSYNC=1 stubs every fsync (Python's, and libgit2's setting is never switched on): the CPU cost alone.
EACH=1 has libgit2 sync each new object on its own (cas.loose_objects.BATCH off), as before the batch.
"""
import os, statistics, subprocess, sys, tempfile, time

src = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 40
sys.path.insert(0, src)
from patcher.protocol import apply  # noqa: E402
if os.environ.get("NOSYNC"):  # CPU cost only: no fsync from Python or libgit2
    os.fsync = lambda fd: None
    try:
        from cas.loose_objects import enable_fsync
        enable_fsync(False)  # set once: no store switches it on
    except ImportError:  # a tree from before cas.loose_objects
        import cas.objects
        cas.objects._FSYNC_ON = True
if os.environ.get("EACH"):  # a call's new objects synced one by one by libgit2, as before the batch
    import cas.loose_objects
    cas.loose_objects.BATCH = False

root = tempfile.mkdtemp(prefix="h1bench-")
repo = os.path.join(root, "repo")
env = {**os.environ, "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@x", "GIT_COMMITTER_NAME": "b",
       "GIT_COMMITTER_EMAIL": "b@x"}
subprocess.run(["git", "init", "-q", "-b", "main", repo], check=True)
for i in range(1000):
    d = os.path.join(repo, f"d{i % 20}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"f{i}.txt"), "w") as fh:
        fh.write("".join(f"line {j} of file {i}\n" for j in range(20)))
subprocess.run(["git", "-C", repo, "add", "-A"], check=True)
subprocess.run(["git", "-C", repo, "commit", "-qm", "init"], check=True, env=env)
subprocess.run(["git", "-C", repo, "branch", "work"], check=True)
os.environ.update({k: v for k, v in env.items() if k.startswith("GIT_")})
stores: dict = {}
times = []
for k in range(n + 3):
    i = k % 1000
    path = f"d{i % 20}/f{i}.txt"
    old = f"line 5 of file {i}\n" if k < 1000 else None
    patch = (f"--- a/{path}\n+++ b/{path}\n@@ -5,3 +5,3 @@\n line 4 of file {i}\n-line 5 of file {i}\n"
             f"+changed {k}\n line 6 of file {i}\n")
    t = time.perf_counter()
    apply(repo, patch, key=f"k{k}", branch="work", _stores=stores)
    dt = time.perf_counter() - t
    if k >= 3:
        times.append(dt)
print(f"{src}: median {statistics.median(times) * 1000:.2f} ms over {len(times)} (min {min(times) * 1000:.2f})")
subprocess.run(["git", "-C", repo, "fsck", "--full", "--strict"], check=True)
