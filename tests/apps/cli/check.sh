# Sourced by the command-line test scripts: a scratch folder removed on exit, and
# `check NAME EXPECTED_RC NEEDLE -- command...`, which runs the command and counts it passed
# when it exits with EXPECTED_RC and its output holds NEEDLE.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fails=0
pass=0

check() {
  local name=$1 want=$2 needle=$3
  shift 4
  local out rc
  out=$("$@" 2>&1)
  rc=$?
  if [ "$rc" -ne "$want" ] || ! grep -qF -- "$needle" <<<"$out"; then
    echo "FAIL $name: rc=$rc (want $want), output:"
    echo "$out" | tail -5
    fails=$((fails + 1))
  else
    pass=$((pass + 1))
  fi
}
