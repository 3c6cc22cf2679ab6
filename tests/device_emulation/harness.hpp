// A command loop that runs a kernel source's entry functions on the emulator (emulator.hpp),
// driven from Python (tests/device_emulation/run.py) over stdin:
//
//   buffer NAME BYTES [FILE]    a zero-filled host buffer, or FILE's bytes
//   launch FUNCTION GX GY GZ BX BY BZ SHARED ARG...    ARG: p:NAME (p:0 null), i:INT, f:FLOAT,
//                                                      t:... (a tensor map: tensor_map below)
//   dump NAME FILE              the buffer's bytes to FILE
//
// Each entry is registered with its signature, so arguments convert to what it takes.
#pragma once

#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>

#include <cuda.h>

#include "emulator.hpp"

namespace emu {

inline std::map<std::string, std::vector<unsigned char>> buffers;

inline void fail(const std::string& message) {
    std::cerr << message << std::endl;
    std::exit(2);
}

// t:BUFFER:ELEMENT_BYTES:SWIZZLE:D0,D1,D2:S1,S2:B0,B1,B2 (emulate.py's TensorMap argument)
inline CUtensorMap tensor_map(const std::string& value) {
    std::vector<std::string> parts;
    std::stringstream stream(value);
    for (std::string part; std::getline(stream, part, ':');) parts.push_back(part);
    if (parts.size() != 6) fail("a tensor map argument has six fields: " + value);
    auto numbers = [](const std::string& text) {
        std::vector<uint64_t> found;
        std::stringstream list(text);
        for (std::string n; std::getline(list, n, ',');) found.push_back(std::stoull(n));
        return found;
    };
    auto found = buffers.find(parts[0]);
    if (found == buffers.end()) fail("no buffer " + parts[0]);
    const auto dims = numbers(parts[3]), strides = numbers(parts[4]), box = numbers(parts[5]);
    if (dims.size() != 3 || strides.size() != 2 || box.size() != 3)
        fail("tensor maps of three dimensions only: " + value);
    TensorMapInfo info{found->second.data(), std::stoi(parts[1]), std::stoi(parts[2]),
                       {dims[0], dims[1], dims[2]}, {strides[0], strides[1]},
                       {static_cast<uint32_t>(box[0]), static_cast<uint32_t>(box[1]),
                        static_cast<uint32_t>(box[2])}};
    static_assert(sizeof(TensorMapInfo) <= sizeof(CUtensorMap), "fits the opaque bytes");
    CUtensorMap map{};
    std::memcpy(&map, &info, sizeof(info));
    return map;
}

template <class T>
T convert(const std::string& argument) {
    const std::string kind = argument.substr(0, 2), value = argument.substr(2);
    if constexpr (std::is_same_v<std::remove_cv_t<T>, CUtensorMap>) {
        if (kind != "t:") fail("expected a tensor map argument, got " + argument);
        return tensor_map(value);
    } else if constexpr (std::is_pointer_v<T>) {
        if (kind != "p:") fail("expected a pointer argument, got " + argument);
        if (value == "0") return nullptr;
        auto found = buffers.find(value);
        if (found == buffers.end()) fail("no buffer " + value);
        return reinterpret_cast<T>(found->second.data());
    } else if constexpr (std::is_floating_point_v<T>) {
        if (kind != "f:") fail("expected a float argument, got " + argument);
        return static_cast<T>(std::stod(value));
    } else {
        if (kind != "i:") fail("expected an integer argument, got " + argument);
        return static_cast<T>(std::stoll(value));
    }
}

using Entry = std::function<void(Dim3, Dim3, size_t, const std::vector<std::string>&)>;

template <class... Params>
Entry entry(void (*function)(Params...)) {
    return [function](Dim3 grid, Dim3 threads, size_t shared,
                      const std::vector<std::string>& arguments) {
        if (arguments.size() != sizeof...(Params))
            fail("wrong argument count: " + std::to_string(arguments.size()) + " for " +
                 std::to_string(sizeof...(Params)));
        auto converted = [&]<size_t... I>(std::index_sequence<I...>) {
            return std::tuple<Params...>(convert<Params>(arguments[I])...);
        }(std::index_sequence_for<Params...>{});
        launch(grid, threads, shared, [&] { std::apply(function, converted); });
    };
}

inline int serve(const std::map<std::string, Entry>& entries) {
    std::string line;
    while (std::getline(std::cin, line)) {
        std::istringstream words(line);
        std::string command;
        if (!(words >> command)) continue;
        if (command == "buffer") {
            std::string name, file;
            size_t bytes;
            words >> name >> bytes;
            std::vector<unsigned char> data(bytes, 0);
            if (words >> file) {
                std::ifstream in(file, std::ios::binary);
                in.read(reinterpret_cast<char*>(data.data()), bytes);
                if (in.gcount() != static_cast<std::streamsize>(bytes)) fail("short file " + file);
            }
            buffers[name] = std::move(data);
        } else if (command == "launch") {
            std::string name;
            Dim3 grid, threads;
            size_t shared;
            words >> name >> grid.x >> grid.y >> grid.z >> threads.x >> threads.y >> threads.z >>
                shared;
            std::vector<std::string> arguments;
            for (std::string argument; words >> argument;) arguments.push_back(argument);
            auto found = entries.find(name);
            if (found == entries.end()) fail("no entry function " + name);
            found->second(grid, threads, shared, arguments);
        } else if (command == "dump") {
            std::string name, file;
            words >> name >> file;
            auto found = buffers.find(name);
            if (found == buffers.end()) fail("no buffer " + name);
            std::ofstream out(file, std::ios::binary);
            out.write(reinterpret_cast<const char*>(found->second.data()), found->second.size());
        } else {
            fail("unknown command " + command);
        }
    }
    return 0;
}

}  // namespace emu

#define EMULATED_ENTRY(function) \
    { #function, emu::entry(function) }
