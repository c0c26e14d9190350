#include "autograd/graph.h"

#include <unordered_map>
#include <unordered_set>

#include "autograd/backend/dispatch.h"

namespace kvlab {

namespace {
std::atomic<uint64_t> g_nodes_created{0};
thread_local bool g_grad_enabled = true;
}  // namespace

Node::Node() { g_nodes_created.fetch_add(1, std::memory_order_relaxed); }

uint64_t nodes_created() { return g_nodes_created.load(std::memory_order_relaxed); }

bool grad_enabled() { return g_grad_enabled; }

NoGradGuard::NoGradGuard() : prev_(g_grad_enabled) { g_grad_enabled = false; }
NoGradGuard::~NoGradGuard() { g_grad_enabled = prev_; }

bool needs_grad(std::initializer_list<const Tensor*> inputs) {
  if (!g_grad_enabled) return false;
  for (const Tensor* t : inputs)
    if (t->defined() && (t->requires_grad() || t->grad_fn())) return true;
  return false;
}

namespace {

// Post-order DFS from the root gives a topological order; reversed, every node runs after all
// the nodes that consume its output.
std::vector<Node*> topo_order(Node* root) {
  std::vector<Node*> order;
  std::unordered_set<Node*> seen;
  std::vector<std::pair<Node*, size_t>> stack{{root, 0}};
  seen.insert(root);
  while (!stack.empty()) {
    auto& [node, next] = stack.back();
    if (next < node->inputs.size()) {
      const Tensor& in = node->inputs[next++];
      Node* child = in.defined() ? in.grad_fn().get() : nullptr;
      if (child != nullptr && seen.insert(child).second) stack.emplace_back(child, 0);
    } else {
      order.push_back(node);
      stack.pop_back();
    }
  }
  return order;
}

// slot = slot + g, a fresh tensor (slot may share its storage with a tensor handed out),
// recorded nowhere: accumulation is not differentiated, whatever the grad mode. The add kernel
// straight from the backend, so that the graph does not depend on the ops built on it: the
// same elementwise sums, so the same bits, as the op `add` gave.
void accumulate(Tensor& slot, const Tensor& g) {
  if (!slot.defined()) {
    slot = g;
    return;
  }
  KVLAB_ASSERT(slot.sizes() == g.sizes() && slot.dtype() == g.dtype() &&
                   slot.device() == g.device(),
               "backward: a gradient ", g.shape_str(), " does not match the ", slot.shape_str(),
               " one it adds to");
  const Tensor a = slot.contiguous(), b = g.contiguous();
  Tensor sum = Tensor::empty(a.sizes(), a.dtype(), a.device());
  const std::vector<int64_t> n{a.numel()};
  const Strides one{1};
  dispatch_float(a.dtype(), "backward", [&](auto tag) {
    using T = decltype(tag);
    KVLAB_KERNEL(a.device(), binary_forward<T>(BinaryOp::Add, sum.data<T>(), n, a.data<T>(), one,
                                               b.data<T>(), one));
  });
  slot = sum;
}

}  // namespace

// Tensor's member, defined with the graph it runs: tensor.* sits below graph.*.
void Tensor::backward(const Tensor& grad, bool keep_graph) const {
  run_backward(*this, grad, keep_graph);
}

void run_backward(const Tensor& root, const Tensor& grad_in, bool keep_graph) {
  KVLAB_CHECK(root.requires_grad() || root.grad_fn(),
              "backward: the tensor ", root.shape_str(), " does not require grad and has no graph");
  Tensor grad = grad_in;
  if (!grad.defined()) {
    KVLAB_CHECK(root.numel() == 1, "backward: no gradient given for non-scalar output ",
                root.shape_str(), "; pass one of the same shape");
    grad = Tensor::full(root.sizes(), 1.0, root.dtype(), root.device());
  }
  KVLAB_CHECK(grad.sizes() == root.sizes(), "backward: gradient ", grad.shape_str(),
              " does not match output ", root.shape_str());
  KVLAB_CHECK(grad.dtype() == root.dtype(), "backward: gradient ", dtype_name(grad.dtype()),
              " for ", dtype_name(root.dtype()), " output ", root.shape_str());
  KVLAB_CHECK(grad.device() == root.device(), "backward: gradient on ",
              device_name(grad.device()), " for an output on ", device_name(root.device()));
  NoGradGuard no_grad;
  if (!root.grad_fn()) {  // a leaf: its gradient is the given one
    Tensor r = root;
    Tensor slot = r.grad();
    accumulate(slot, slot.defined() ? grad : grad.clone());  // never alias the caller's tensor
    r.set_grad(slot);
    return;
  }
  std::vector<Node*> order = topo_order(root.grad_fn().get());
  std::unordered_map<Node*, Tensor> pending;
  pending[root.grad_fn().get()] = grad;
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    Node* node = *it;
    KVLAB_CHECK(!node->released, "backward: the graph through ", node->name(),
                " was already released by an earlier backward(); pass keep_graph=true to the "
                "first call to run backward twice");
    auto found = pending.find(node);
    if (found == pending.end()) continue;  // no gradient reached this node
    Tensor g = std::move(found->second);
    pending.erase(found);
    std::vector<Tensor> grads = node->backward(g);
    KVLAB_ASSERT(grads.size() == node->inputs.size(), node->name());
    for (size_t i = 0; i < grads.size(); ++i) {
      Tensor& in = node->inputs[i];
      if (!in.defined() || !grads[i].defined()) continue;
      KVLAB_ASSERT(grads[i].sizes() == in.sizes(), node->name(), " input ", i, " grad ",
                   grads[i].shape_str(), " vs ", in.shape_str());
      if (in.grad_fn()) {
        accumulate(pending[in.grad_fn().get()], grads[i]);
      } else if (in.requires_grad()) {
        Tensor slot = in.grad();
        // A gradient may alias a buffer something else still holds (pass-through ops, the
        // caller's tensor): copy it the first time it becomes a leaf's .grad, unless this is
        // its only handle and nothing else shares its storage (the common case of a fresh
        // weight gradient, which then moves in without a copy).
        const bool sole_owner = grads[i].impl_ptr().use_count() == 1 &&
                                grads[i].storage().use_count() == 1 && grads[i].is_contiguous();
        accumulate(slot, slot.defined() || sole_owner ? grads[i] : grads[i].clone());
        in.set_grad(slot);
      }
    }
  }
  if (!keep_graph) {
    for (Node* node : order) {
      node->release();
      node->inputs.clear();
      node->released = true;
    }
  }
}

}  // namespace kvlab
