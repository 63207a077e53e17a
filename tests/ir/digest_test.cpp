// ir/digest.h against FNV-1a's published 64-bit test vectors (the offset basis was once one digit short).
#include "ir/digest.h"

#include <gtest/gtest.h>

#include <cstring>

namespace frag::ir {
namespace {

TEST(DigestTest, MatchesTheFnv1aTestVectors) {
  EXPECT_EQ(fnv1a(""), 0xcbf29ce484222325ull);
  EXPECT_EQ(fnv1a("a"), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(fnv1a("foobar"), 0x85944171f73967e8ull);
}

TEST(DigestTest, ChainedPartsEqualTheWhole) {
  EXPECT_EQ(fnv1a("bar", fnv1a("foo")), fnv1a("foobar"));
  EXPECT_EQ(fnv1a_bytes("bar", 3, fnv1a_bytes("foo", 3)), fnv1a("foobar"));
}

TEST(DigestTest, LittleEndianValuesEqualTheirBytes) {
  const uint64_t value = 0x0102030405060708ull;
  const unsigned char bytes[8] = {8, 7, 6, 5, 4, 3, 2, 1};
  EXPECT_EQ(fnv1a_le(value), fnv1a_bytes(bytes, sizeof bytes));
  EXPECT_NE(fnv1a_le(value), fnv1a_le(value + 1));
}

}  // namespace
}  // namespace frag::ir
