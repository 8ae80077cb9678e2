#include <gtest/gtest.h>

#include "server/server.h"

namespace flatshard::server {
namespace {

TEST(AdvertisedDataAddressTest, IsTheDataListenHostWithTheBoundPort) {
  EXPECT_EQ(AdvertisedDataAddress("10.0.0.1", "10.0.0.1", 7071), "10.0.0.1:7071");
  // A data plane on another interface (a faster network) is advertised as such.
  EXPECT_EQ(AdvertisedDataAddress("10.0.0.1", "192.168.7.1", 7071), "192.168.7.1:7071");
  EXPECT_EQ(AdvertisedDataAddress("flatshard-0.flatshard", "flatshard-0.flatshard", 40123),
            "flatshard-0.flatshard:40123");
}

TEST(AdvertisedDataAddressTest, EveryInterfaceIsAdvertisedAsTheControlHost) {
  // Bound to 0.0.0.0, the data plane is reached where the control plane is: a client on
  // another node told 0.0.0.0 would connect to its own machine.
  EXPECT_EQ(AdvertisedDataAddress("10.0.0.1", "0.0.0.0", 7071), "10.0.0.1:7071");
  EXPECT_EQ(AdvertisedDataAddress("flatshard-1.flatshard", "0.0.0.0", 7071), "flatshard-1.flatshard:7071");
}

}  // namespace
}  // namespace flatshard::server
