// Writes kMetalLibrarySource, the string the executor hands to MLX's
// Device::get_library, to the file named by argv[1]: the compiler itself reads
// the generated raw string literal, so the text is exactly what Metal receives.
// The generated header is named by METAL_LIBRARY_HEADER (check_library.py).
#include <cstdio>
#include <cstring>

#include METAL_LIBRARY_HEADER

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUTPUT\n", argv[0]);
    return 2;
  }
  std::FILE* out = std::fopen(argv[1], "wb");
  if (out == nullptr) {
    std::perror(argv[1]);
    return 1;
  }
  const char* text = mlx_gated_delta::metal::kMetalLibrarySource;
  const std::size_t length = std::strlen(text);
  const bool written = std::fwrite(text, 1, length, out) == length;
  return std::fclose(out) == 0 && written ? 0 : 1;
}
