# Versions and paths shared by the e2e/cluster scripts; sourced, not run.
# Changing a version changes the cache key, so the next `up` builds afresh.
KUBE_VERSION=v1.37.2 # k8s.io/kubernetes; etcd is the one it pins (see k8s/go.mod)
KWOK_VERSION=v0.8.0  # sigs.k8s.io/kwok

CLUSTER_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE_ROOT=${XDG_CACHE_HOME:-$HOME/.cache}/meridian
KUBE_BIN=$CACHE_ROOT/k8s-$KUBE_VERSION/bin
KWOK_BIN=$CACHE_ROOT/kwok-$KWOK_VERSION/bin
# One cluster per checkout; its state lives outside the repository and `down` removes it.
STATE_DIR=${MERIDIAN_CLUSTER_STATE:-${TMPDIR:-/tmp}/meridian-cluster-$(echo "$CLUSTER_DIR" | cksum | cut -d' ' -f1)}
