#!/bin/bash
# Cross-version check with real processes: a node of the release before XXH3 against this
# client, this node against that release's client, and this node warm-restarted on the
# older node's data dir (every value read back and compared byte for byte).
#
#   OLD=<checkout of the previous release, its _native built> bash bench/store/cross_version.sh
#
# Prints one line per check; every one should say True (or, for this client's TCP PUT on
# the old node, the clear refusal naming GCACHE_CHECKSUM=xxh64).
set -u
OLD=${OLD:?set OLD to a checkout of the previous release}
NEW=${NEW:-$(cd "$(dirname "$0")/../.." && pwd)}
PY=${PYTHON:-$NEW/.venv/bin/python}
W=$(mktemp -d -t gcache-cross-XXXXXX)
D=$W/data; mkdir -p $D
start() { # $1 = code root, $2 = port
  (cd /tmp; PYTHONPATH=$1 exec $PY -m gcache.server.main --host 127.0.0.1 --port $2 --admin-port $(($2+1)) --memory 64MiB --disk 256MiB --data-dir $D > $W/server-$2.log 2>&1) &
  echo $! > $W/pid-$2
  for i in $(seq 100); do (echo > /dev/tcp/127.0.0.1/$2) 2>/dev/null && return; sleep 0.2; done; echo "no server"; }
stop() { kill -TERM $(cat $W/pid-$1); while kill -0 $(cat $W/pid-$1) 2>/dev/null; do sleep 0.2; done; }
client() { (cd /tmp && PYTHONPATH=$1 $PY -c "$2"); }
VALS='import random; vals={b"v%d"%i: random.Random(i).randbytes([0,1,100,4096,70000,262144,1<<20][i%7]) for i in range(40)}'
echo "== old node (OLD), written by the old client, then new client"
start $OLD 47111
client $OLD "$VALS
import gcache; c=gcache.Client('127.0.0.1:47111', transport='tcp', verify_checksums=True)
print('old client put', all(c.put_batch(list(vals), list(vals.values()))))"
client $NEW "$VALS
import gcache
for t in ('tcp','shm'):
  try:
    c=gcache.Client('127.0.0.1:47111', transport=t, verify_checksums=True)
    print('new client', t, 'reads old node exactly:', c.get_batch(list(vals)) == list(vals.values()))
    if True:
        print('new client', t, 'put on old node:', c.put_batch([b'n-'+t.encode()], [b'x'*5000]))
        print('  read back', c.get_batch([b'n-'+t.encode()]) == [b'x'*5000])
  except Exception as e: print('  refused:', type(e).__name__, e)
import os; os.environ['GCACHE_CHECKSUM']='xxh64'
c=gcache.Client('127.0.0.1:47111', transport='tcp', verify_checksums=True)
print('new client tcp GCACHE_CHECKSUM=xxh64 put on old node:', c.put_batch([b'n-env'], [b'y'*5000]), c.get_batch([b'n-env'])==[b'y'*5000])"
stop 47111
echo "== new node (this build) on the old node's data dir (warm restart)"
start $NEW 47121
client $NEW "$VALS
import gcache; c=gcache.Client('127.0.0.1:47121', transport='tcp', verify_checksums=True)
print('upgrade keeps every value exactly:', c.get_batch(list(vals)) == list(vals.values()))
print('stats checksum_failures', c.stats()['counters']['checksum_failures'])"
client $OLD "$VALS
import gcache
for t in ('tcp','shm'):
    c=gcache.Client('127.0.0.1:47121', transport=t, verify_checksums=True)
    print('old client', t, 'put on new node:', all(c.put_batch([b'o-'+t.encode()+b'%d'%i for i in range(3)], [b'z'*70000]*3)))
    print('old client', t, 'reads old values exactly:', c.get_batch(list(vals)) == list(vals.values()))"
client $NEW "
import gcache
c=gcache.Client('127.0.0.1:47121', transport='tcp', verify_checksums=True)
print('new client put', c.put_batch([b'new%d'%i for i in range(3)], [b'q'*300000]*3))"
client $OLD "
import gcache
for t in ('tcp','shm'):
    c=gcache.Client('127.0.0.1:47121', transport=t, verify_checksums=True)
    print('old client', t, 'reads XXH3 values exactly (node sends xxh64):', c.get_batch([b'new%d'%i for i in range(3)]) == [b'q'*300000]*3)"
stop 47121
echo "== this build restarted on the mixed dir"
start $NEW 47131
client $NEW "$VALS
import gcache; c=gcache.Client('127.0.0.1:47131', transport='shm', verify_checksums=True)
print('mixed dir:', c.get_batch(list(vals)) == list(vals.values()), c.get_batch([b'new%d'%i for i in range(3)]) == [b'q'*300000]*3, c.get_batch([b'o-tcp0', b'o-shm0']) == [b'z'*70000]*2)"
stop 47131
rm -rf "$W"
