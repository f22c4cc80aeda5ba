// Test driver for the open tensorflow-metal-plugin's graph pass (tests/plugin_pass).
//
// Reads a serialized GraphDef on stdin, hands it to tensorflow::metal::FuseGraph
// (compiled from the plugin's sdist next to this file; tfmetal-ext ships none of
// that code) and writes the rewritten GraphDef on stdout. Exit status 0 when the
// pass accepted the graph, 2 when FuseGraph returned false (it could not parse
// the input), 1 on an I/O error.

#include <cstdint>
#include <cstdio>
#include <vector>

namespace tensorflow {
namespace metal {
// Declared in the plugin's metal_graph.h; repeated here so this driver needs
// nothing from the plugin at compile time but the symbol.
bool FuseGraph(const uint8_t* data, size_t size, std::vector<uint8_t>* out);
}  // namespace metal
}  // namespace tensorflow

int main() {
  std::vector<uint8_t> input;
  uint8_t chunk[1 << 16];
  size_t got = 0;
  while ((got = std::fread(chunk, 1, sizeof(chunk), stdin)) > 0) {
    input.insert(input.end(), chunk, chunk + got);
  }
  if (std::ferror(stdin)) {
    std::fprintf(stderr, "fuse_graph_driver: could not read stdin\n");
    return 1;
  }
  std::vector<uint8_t> output;
  if (!tensorflow::metal::FuseGraph(input.data(), input.size(), &output)) {
    std::fprintf(stderr, "fuse_graph_driver: FuseGraph returned false for %zu input bytes\n", input.size());
    return 2;
  }
  if (!output.empty() && std::fwrite(output.data(), 1, output.size(), stdout) != output.size()) {
    std::fprintf(stderr, "fuse_graph_driver: could not write stdout\n");
    return 1;
  }
  return std::fflush(stdout) == 0 ? 0 : 1;
}
