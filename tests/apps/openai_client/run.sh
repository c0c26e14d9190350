#!/usr/bin/env bash
# End-to-end check of `kvlab serve` with the official openai npm client: train a tiny model,
# take `kvlab generate`'s continuation as the expected text (and `kvlab generate --chat`'s
# reply, through a chat template, as the expected chat), serve the checkpoint on an ephemeral
# port, run completions.mjs against it, then stop the server with SIGINT.
# Usage: run.sh /path/to/kvlab. Exits 77 (skipped) without node or the openai package.
set -u
KVLAB=${1:?usage: run.sh /path/to/kvlab}
here=$(cd "$(dirname "$0")" && pwd)

if ! command -v node >/dev/null 2>&1 || [ ! -d "$here/node_modules/openai" ]; then
  echo "SKIP: the openai package is not installed (scripts/setup.sh --tests installs it)"
  exit 77
fi

work=$(mktemp -d)
server_pid=
cleanup() {
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
    kill -KILL "$server_pid" 2>/dev/null
    wait "$server_pid" 2>/dev/null
  fi
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

step=setup
fail() {
  echo "FAIL ($step): $*"
  for f in "$work/serve.log" "$work/serve.out"; do
    if [ -s "$f" ]; then
      echo "--- tail of $(basename "$f"):"
      tail -20 "$f"
    fi
  done
  exit 1
}

step=train
for i in $(seq 300); do echo "the lord is my shepherd; i shall not want $((i % 7))."; done > "$work/corpus.txt"
"$KVLAB" train --corpus "$work/corpus.txt" --n-layer 1 --n-head 4 --n-embd 16 --block-size 16 \
  --batch-size 4 --iters 20 --eval-interval 10 --eval-iters 2 --n-kv-head 2 \
  --out "$work/run" > "$work/train.log" 2>&1 || fail "kvlab train failed: $(tail -5 "$work/train.log")"
ckpt=$work/run/final.h5
[ -f "$ckpt" ] || fail "no checkpoint at $ckpt"
echo "ok: train"

step=generate
"$KVLAB" generate --ckpt "$ckpt" --prompt "the lord" --max-new 8 --temperature 1 --seed 7 --json \
  > "$work/generate.json" 2> "$work/generate.err" || fail "kvlab generate failed: $(tail -5 "$work/generate.err")"
# A trailing '.' keeps trailing newlines of the text through the command substitution.
expected=$(node -e '
  let s = "";
  process.stdin.on("data", (d) => (s += d)).on("end", () => {
    const t = JSON.parse(s).texts?.[0];
    if (typeof t !== "string") { console.error("no texts[0] in the JSON"); process.exit(1); }
    process.stdout.write(t + ".");
  });' < "$work/generate.json") || fail "cannot read texts[0] from: $(head -c 300 "$work/generate.json")"
expected=${expected%.}
echo "ok: generate (expected text: $(printf '%q' "$expected"))"

# A chat template in the corpus's characters (the model's vocabulary): the turns joined by
# '; ', then ' i' where the reply begins.
cat > "$work/chat.jinja" <<'JINJA'
{%- for m in messages -%}
  {{ m['content'] | trim }}{% if not loop.last %}; {% endif %}
{%- endfor -%}
{%- if add_generation_prompt %} i{% endif %}
JINJA
"$KVLAB" generate --ckpt "$ckpt" --chat --chat-template "$work/chat.jinja" --system "the" \
  --prompt "lord" --max-new 4 --temperature 1 --seed 7 --json \
  > "$work/chat.json" 2> "$work/chat.err" || fail "kvlab generate --chat failed: $(tail -5 "$work/chat.err")"
expected_chat=$(node -e '
  let s = "";
  process.stdin.on("data", (d) => (s += d)).on("end", () => process.stdout.write(JSON.parse(s).texts[0] + "."));
  ' < "$work/chat.json") || fail "cannot read texts[0] from: $(head -c 300 "$work/chat.json")"
expected_chat=${expected_chat%.}
echo "ok: generate --chat (expected reply: $(printf '%q' "$expected_chat"))"

step=serve
# Asynchronous commands of a non-interactive shell start with SIGINT ignored; restore the
# default so the server sees SIGINT as it would from a terminal.
reset_int=()
env --default-signal=INT true 2>/dev/null && reset_int=(env --default-signal=INT)
# The key comes from the environment (the flag's fallback); the client sends it.
api_key=sk-kvlab-test-$$
KVLAB_API_KEY=$api_key "${reset_int[@]}" "$KVLAB" serve --ckpt "$ckpt" --port 0 \
  --chat-template "$work/chat.jinja" \
  > "$work/serve.out" 2> "$work/serve.log" &
server_pid=$!
port=
for _ in $(seq 300); do
  port=$(sed -n 's|.*serving .* on http://127\.0\.0\.1:\([0-9][0-9]*\).*|\1|p' "$work/serve.log" | head -1)
  [ -n "$port" ] && break
  if ! kill -0 "$server_pid" 2>/dev/null; then
    wait "$server_pid"
    rc=$?
    server_pid=
    fail "kvlab serve exited with status $rc before listening"
  fi
  sleep 0.1
done
[ -n "$port" ] || fail "kvlab serve printed no 'serving ... on http://127.0.0.1:PORT' line within 30 s"
echo "ok: serve listening on port $port"

step=client
KVLAB_BASE_URL="http://127.0.0.1:$port/v1" KVLAB_EXPECTED_TEXT="$expected" KVLAB_API_KEY="$api_key" \
  KVLAB_EXPECTED_CHAT="$expected_chat" \
  timeout 180 node "$here/completions.mjs" || fail "completions.mjs failed (status $?)"

step=shutdown
kill -INT "$server_pid" 2>/dev/null || fail "cannot signal the server (pid $server_pid)"
for _ in $(seq 200); do
  kill -0 "$server_pid" 2>/dev/null || break
  sleep 0.1
done
kill -0 "$server_pid" 2>/dev/null && fail "kvlab serve still running 20 s after SIGINT"
wait "$server_pid"
rc=$?
server_pid=
[ "$rc" -eq 0 ] || fail "kvlab serve exited with status $rc after SIGINT (want 0)"
grep -q "server stopped" "$work/serve.log" || fail "no 'server stopped' in the server log"
echo "ok: server stopped on SIGINT"
echo "PASS: kvlab serve with the openai client"
