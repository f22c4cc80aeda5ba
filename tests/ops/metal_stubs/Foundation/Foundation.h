// Stand-in for the part of Apple's Foundation that custom_ops/metal/*.mm use,
// so tests/ops/test_metal_host_code.py can syntax-check the host code with
// clang on Linux (-fsyntax-only, never linked or run). Declarations follow the
// macOS SDK's signatures; add what new host code needs, as the SDK spells it.
#pragma once

#include <stddef.h>
#include <stdint.h>

typedef unsigned long NSUInteger;
typedef long NSInteger;
typedef signed char BOOL;
#define YES ((BOOL)1)
#define NO ((BOOL)0)
#define NSUIntegerMax ((NSUInteger)~0UL)
#define NS_ENUM(type, name) enum name : type name; enum name : type
#define NS_OPTIONS(type, name) enum name : type name; enum name : type
#ifndef nil
#define nil nullptr
#endif

@class Protocol;
typedef struct objc_selector* SEL;

@protocol NSObject
- (BOOL)respondsToSelector:(SEL)aSelector;
- (BOOL)conformsToProtocol:(Protocol*)aProtocol;
@end

__attribute__((objc_root_class))
@interface NSObject <NSObject>
+ (instancetype)alloc;
- (instancetype)init;
@end

@interface Protocol : NSObject
@end

@interface NSString : NSObject
+ (instancetype)stringWithUTF8String:(const char*)nullTerminatedCString;
@property(readonly) const char* UTF8String;
@end

@interface NSError : NSObject
@property(readonly, copy) NSString* localizedDescription;
@end

@interface NSURL : NSObject
+ (NSURL*)fileURLWithPath:(NSString*)path;
@end

// libdispatch (<dispatch/dispatch.h>, included by Foundation).
@protocol OS_dispatch_queue <NSObject>
@end
typedef NSObject<OS_dispatch_queue>* dispatch_queue_t;
typedef void (^dispatch_block_t)(void);
extern "C" void dispatch_sync(dispatch_queue_t queue, dispatch_block_t block);
