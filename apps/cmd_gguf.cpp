// kvlab export and kvlab import: a checkpoint as a GGUF file that llama.cpp (and ollama) run,
// and a llama-architecture GGUF file as a checkpoint (checkpoints/gguf_model.h, docs/gguf.md).
#include <cstdio>
#include <filesystem>
#include <map>

#include "apps/cli.h"
#include "checkpoints/gguf_model.h"
#include "checkpoints/model_io.h"

namespace kvlab {

namespace {

struct ExportArgs {
  std::string ckpt, format = "gguf", out, dtype = "f32", mla_up = "split";
  bool pure = false;
};

// "q4_k 10, q6_k 5, f32 9": how many tensors the file holds of each type.
std::string tensor_type_counts(const GgufFile& file) {
  std::map<std::string, int> counts;
  std::vector<std::string> order;
  for (const GgufTensor& t : file.tensors)
    if (counts[ggml_type_name(t.type)]++ == 0) order.push_back(ggml_type_name(t.type));
  std::string out;
  for (const std::string& name : order)
    out += (out.empty() ? "" : ", ") + name + " " + std::to_string(counts[name]);
  return out;
}

void run_export(const ExportArgs& a) {
  KVLAB_USAGE_CHECK(!a.ckpt.empty(), "export: --ckpt is empty");
  KVLAB_USAGE_CHECK(!a.out.empty(), "export: --out is empty");
  KVLAB_USAGE_CHECK(!same_file(a.ckpt, a.out), "--out ", a.out,
                    " is the checkpoint --ckpt reads; write the export to another file");
  const LoadedModel src = load_model(a.ckpt, /*with_training_state=*/true);
  GgufProvenance provenance;
  provenance.source_file = a.ckpt;
  provenance.source_hash = file_content_hash(a.ckpt);
  if (src.checkpoint.has_train_state) {
    provenance.iteration = src.checkpoint.iteration;
    provenance.best_val_loss = src.checkpoint.best_val_loss;
  }
  const GgufFile file =
      model_to_gguf(*src.model, src.tokenizer, gguf_mix(a.dtype), provenance,
                    a.mla_up == "whole" ? MlaUpForm::Whole : MlaUpForm::Split, a.pure);
  const std::filesystem::path out(a.out);
  if (out.has_parent_path()) std::filesystem::create_directories(out.parent_path());
  write_gguf(out, file);
  std::printf("exported %s (%s architecture, %lld parameters, %s tokenizer) to %s as %s%s (%s)\n",
              a.ckpt.c_str(), file.get_string("general.architecture", a.out).c_str(),
              static_cast<long long>(src.model->num_parameters()),
              src.tokenizer.kind_name().c_str(), a.out.c_str(), a.dtype.c_str(),
              a.pure ? " --pure" : "", tensor_type_counts(file).c_str());
}

struct ImportArgs {
  std::string gguf, out;
};

void run_import(const ImportArgs& a) {
  KVLAB_USAGE_CHECK(!a.gguf.empty(), "import: --gguf is empty");
  KVLAB_USAGE_CHECK(!a.out.empty(), "import: --out is empty");
  KVLAB_USAGE_CHECK(!same_file(a.gguf, a.out), "--out ", a.out,
                    " is the file --gguf reads; write the checkpoint to another file");
  Checkpoint c = gguf_to_checkpoint(read_gguf(a.gguf), a.gguf);
  c.config["imported_from"] = file_content_hash(a.gguf);
  save_checkpoint(a.out, c);
  int64_t params = 0;
  for (const auto& [name, arr] : c.model) params += static_cast<int64_t>(arr.data.size());
  std::printf("imported %s (%lld parameters, %s tokenizer) to %s\n", a.gguf.c_str(),
              static_cast<long long>(params), c.tokenizer_kind.c_str(), a.out.c_str());
}

}  // namespace

void add_export_command(CLI::App& root) {
  auto args = std::make_shared<ExportArgs>();
  CLI::App* cmd = root.add_subcommand(
      "export",
      "Write a checkpoint's model and tokenizer as a GGUF file for llama.cpp or ollama: the llama "
      "block as llama.cpp's llama architecture (deepseek2 with --attn mla), GPT-2's as its gpt2 "
      "(docs/gguf.md)");
  cmd->add_option("--ckpt", args->ckpt,
                  "Checkpoint (.h5) or GGUF model file to export (a GGUF file: in another mix)")
      ->required();
  cmd->add_option("--format", args->format, "File format: gguf (the only one)")
      ->check(CLI::IsMember({"gguf"}));
  cmd->add_option("--out", args->out, "GGUF file to write (atomically)")->required();
  cmd->add_option("--dtype", args->dtype,
                  "File type, as llama-quantize makes it: f32, f16, bf16, q8_0, q4_0, q4_k_m, "
                  "q5_k_m or q6_k. Each tensor takes the type llama.cpp's rules give it for that "
                  "mix (the LM head q6_K, but q8_0 in q8_0; attn_v and ffn_down q6_K in "
                  "some layers of q4_k_m and q5_k_m; q5_0, q5_1 or q8_0 where rows are not whole "
                  "blocks of 256); norms and biases stay f32 (docs/gguf.md)")
      ->check(CLI::IsMember(gguf_mix_names()));
  cmd->add_flag("--pure", args->pure,
                "Every matrix in --dtype's own type (q4_k_m: q4_K), but where its rows are not "
                "whole blocks, as llama-quantize --pure");
  cmd->add_option("--mla-up", args->mla_up,
                  "MLA models: the up-projection split per head into attn_k_b and attn_v_b "
                  "(split, llama.cpp's converter's form: it caches the latent) or whole as "
                  "attn_kv_b (whole, the older form; llama.cpp then caches full keys and values)")
      ->check(CLI::IsMember({"split", "whole"}));
  cmd->callback([args] { run_export(*args); });
}

void add_import_command(CLI::App& root) {
  auto args = std::make_shared<ImportArgs>();
  CLI::App* cmd = root.add_subcommand(
      "import",
      "Read a llama- or deepseek2-architecture GGUF file (" + format_names(kGgufTensor, " or ") +
          " tensors, a byte-level BPE vocabulary) into a weights-only checkpoint for generate, "
          "serve, bench, convert and train --init-from");
  cmd->add_option("--gguf", args->gguf, "GGUF file to read")->required();
  cmd->add_option("--out", args->out,
                  "Checkpoint to write: f32 weights, the config the GGUF's keys give, its "
                  "tokenizer, and imported_from (the GGUF's content hash) in /config")
      ->required();
  cmd->callback([args] { run_import(*args); });
}

}  // namespace kvlab
