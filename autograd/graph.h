#pragma once
// The tape: nodes that ops record when an input requires a gradient, and the reverse-mode
// traversal that runs them.
#include <atomic>
#include <cstdint>
#include <vector>

#include "autograd/tensor.h"

namespace kvlab {

// One recorded op. `inputs` are the op's differentiable inputs (an undefined Tensor where the
// op's input needs no gradient); backward returns one gradient per input, each of that input's
// shape (or undefined where none flows).
struct Node {
  Node();
  virtual ~Node() = default;
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  virtual const char* name() const = 0;
  virtual std::vector<Tensor> backward(const Tensor& grad_out) = 0;
  // Drops what backward kept (saved activations). Called once the graph is released.
  virtual void release() = 0;

  std::vector<Tensor> inputs;
  bool released = false;
};

// Nodes created since the process started: tests check that a no-grad scope creates none.
uint64_t nodes_created();

bool grad_enabled();

// RAII scope in which ops record nothing and allocate no node (inference, optimizer updates).
class NoGradGuard {
 public:
  NoGradGuard();
  ~NoGradGuard();
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool prev_;
};

// True when an op with these inputs must record a node.
bool needs_grad(std::initializer_list<const Tensor*> inputs);

// Attaches `node` as the producer of `out` when recording is on; `inputs` become the node's
// edges (inputs that need no grad are stored undefined so nothing is kept alive for them).
template <class N>
void record(Tensor& out, std::shared_ptr<N> node, std::initializer_list<const Tensor*> inputs) {
  for (const Tensor* t : inputs)
    node->inputs.push_back(t->defined() && (t->requires_grad() || t->grad_fn()) ? *t : Tensor());
  out.set_grad_fn(std::move(node));
}

void run_backward(const Tensor& root, const Tensor& grad, bool keep_graph);

}  // namespace kvlab
